from artery.services.console.main import main

main()
