from artery.services.trainer.main import main

main()
