from artery.services.inference.main import main

main()
