"""Entry point: ``python -m artery.services.collector``. Settings are validated before connecting."""

from __future__ import annotations

import asyncio

from artery.services.collector.service import Collector
from artery.services.collector.settings import PREFIX, CollectorSettings
from artery.shared import bus
from artery.shared.db import migrate_when_ready
from artery.shared.errors import ConfigError
from artery.shared.logs import get_logger
from artery.shared.runtime import connect_service, run_service
from artery.shared.settings import CommonSettings, load

log = get_logger(__name__)


async def start(common: CommonSettings, stop: asyncio.Event) -> None:
    settings = load(CollectorSettings, PREFIX)
    if not common.database_url:
        raise ConfigError("the collector needs ARTERY_DATABASE_URL")
    nc = await connect_service("collector", common)
    collector = Collector(nc.jetstream(), common.database_url, settings)
    await migrate_when_ready(common.database_url)
    await collector.start()
    log.info("ready")
    task = asyncio.create_task(collector.run())
    await stop.wait()
    collector.stop()
    await task
    await collector.close()
    await bus.close(nc)


def main() -> None:
    run_service("collector", start)


if __name__ == "__main__":
    main()
