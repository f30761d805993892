from artery.services.collector.main import main

main()
