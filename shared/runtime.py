"""What every service's ``main`` does: settings, logs, traces, NATS, streams, signals."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable

import nats

from artery.shared import bus
from artery.shared.logs import get_logger, setup_logging
from artery.shared.settings import CommonSettings, load
from artery.shared.tracing import setup_tracing

log = get_logger(__name__)


async def connect_service(service: str, common: CommonSettings) -> nats.NATS:
    """Connect to NATS (retrying until it answers) and make sure every stream exists."""
    nc = await bus.connect(common, name=f"artery-{service}")
    await bus.provision(nc.jetstream(), common)
    return nc


def run_service(
    service: str,
    start: Callable[[CommonSettings, asyncio.Event], Awaitable[None]],
) -> None:
    """Read the common settings, set up logs and traces, run ``start`` until SIGTERM/SIGINT."""
    common = load(CommonSettings, "ARTERY_")
    setup_logging(service, common.log_level, common.log_format)
    setup_tracing(service, common.otel_endpoint)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        log.info("starting", nats_url=common.nats_url)
        await start(common, stop)
        log.info("stopped")

    asyncio.run(main())
