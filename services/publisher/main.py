"""Entry point: ``python -m artery.services.publisher``. Settings are validated before connecting."""

from __future__ import annotations

import asyncio

from artery.services.publisher.control import RetentionServer
from artery.services.publisher.service import Publisher
from artery.services.publisher.settings import PREFIX, PublisherSettings
from artery.shared.runtime import run_service
from artery.shared.service_runner import serve_consumers
from artery.shared.settings import CommonSettings, load


async def start(common: CommonSettings, stop: asyncio.Event) -> None:
    settings = load(PublisherSettings, PREFIX)
    await serve_consumers(
        "publisher",
        common,
        stop,
        lambda nc, dsn: Publisher(nc, dsn, settings),
        companions=lambda nc, publisher: [RetentionServer(nc, publisher)],
    )


def main() -> None:
    run_service("publisher", start)


if __name__ == "__main__":
    main()
