"""Entry point: ``python -m artery.services.reward``. Settings are validated before connecting."""

from __future__ import annotations

import asyncio

from artery.services.reward.service import RewardService
from artery.services.reward.settings import PREFIX, RewardSettings
from artery.shared.runtime import run_service
from artery.shared.service_runner import serve_consumers
from artery.shared.settings import CommonSettings, load


async def start(common: CommonSettings, stop: asyncio.Event) -> None:
    settings = load(RewardSettings, PREFIX)
    await serve_consumers(
        "reward",
        common,
        stop,
        lambda nc, dsn: RewardService(nc, dsn, settings),
        title="reward service",
        judge_model=settings.judge_model,
        judge_api_base=settings.judge_api_base,
        allowed_judges=sorted(settings.allowed_judge_models()),
    )


def main() -> None:
    run_service("reward", start)


if __name__ == "__main__":
    main()
