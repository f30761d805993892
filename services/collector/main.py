"""Entry point: ``python -m artery.services.collector``. Settings are validated before connecting."""

from __future__ import annotations

import asyncio

from artery.services.collector.service import Collector
from artery.services.collector.settings import PREFIX, CollectorSettings
from artery.shared.runtime import run_service
from artery.shared.service_runner import serve_consumers
from artery.shared.settings import CommonSettings, load


async def start(common: CommonSettings, stop: asyncio.Event) -> None:
    settings = load(CollectorSettings, PREFIX)
    await serve_consumers("collector", common, stop, lambda nc, dsn: Collector(nc.jetstream(), dsn, settings))


def main() -> None:
    run_service("collector", start)


if __name__ == "__main__":
    main()
