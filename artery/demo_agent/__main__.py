"""``python -m artery.demo_agent``."""

from artery.demo_agent.cli import main

main()
