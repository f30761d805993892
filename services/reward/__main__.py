from artery.services.reward.main import main

main()
