"""Entry point: ``python -m artery.services.publisher``. Settings are validated before connecting."""

from __future__ import annotations

import asyncio

from artery.services.publisher.control import RetentionServer
from artery.services.publisher.service import Publisher
from artery.services.publisher.settings import PREFIX, PublisherSettings
from artery.shared import bus
from artery.shared.db import migrate_when_ready
from artery.shared.errors import ConfigError
from artery.shared.logs import get_logger
from artery.shared.runtime import connect_service, run_service
from artery.shared.settings import CommonSettings, load

log = get_logger(__name__)


async def start(common: CommonSettings, stop: asyncio.Event) -> None:
    settings = load(PublisherSettings, PREFIX)
    if not common.database_url:
        raise ConfigError("the publisher needs ARTERY_DATABASE_URL")
    nc = await connect_service("publisher", common)
    publisher = Publisher(nc, common.database_url, settings)
    retention = RetentionServer(nc, publisher)
    await migrate_when_ready(common.database_url)
    await publisher.start()
    await retention.start()
    log.info("ready")
    task = asyncio.create_task(publisher.run())
    await stop.wait()
    await retention.stop()
    publisher.stop()
    await task
    await publisher.close()
    await bus.close(nc)


def main() -> None:
    run_service("publisher", start)


if __name__ == "__main__":
    main()
