"""``python -m artery.demos.demo_agent``."""

from artery.demos.demo_agent.cli import main

main()
