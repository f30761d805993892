from artery.services.publisher.main import main

main()
