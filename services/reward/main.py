"""Entry point: ``python -m artery.services.reward``. Settings are validated before connecting."""

from __future__ import annotations

import asyncio

from artery.services.reward.service import RewardService
from artery.services.reward.settings import PREFIX, RewardSettings
from artery.shared import bus
from artery.shared.db import migrate_when_ready
from artery.shared.errors import ConfigError
from artery.shared.logs import get_logger
from artery.shared.runtime import connect_service, run_service
from artery.shared.settings import CommonSettings, load

log = get_logger(__name__)


async def start(common: CommonSettings, stop: asyncio.Event) -> None:
    settings = load(RewardSettings, PREFIX)
    if not common.database_url:
        raise ConfigError("the reward service needs ARTERY_DATABASE_URL")
    nc = await connect_service("reward", common)
    await migrate_when_ready(common.database_url)
    service = RewardService(nc, common.database_url, settings)
    await service.start()
    log.info(
        "ready",
        judge_model=settings.judge_model,
        judge_api_base=settings.judge_api_base,
        allowed_judges=sorted(settings.allowed_judge_models()),
    )
    task = asyncio.create_task(service.run())
    await stop.wait()
    service.stop()
    await task
    await service.close()
    await bus.close(nc)


def main() -> None:
    run_service("reward", start)


if __name__ == "__main__":
    main()
