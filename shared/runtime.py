"""What every service's ``main`` does: settings, logs, traces, NATS, streams, signals."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable

import nats

from artery.shared import bus
from artery.shared.logs import get_logger, setup_logging
from artery.shared.metrics import start_metrics_server
from artery.shared.permissions import provision_if_missing
from artery.shared.settings import CommonSettings, load
from artery.shared.tracing import setup_tracing, shutdown_tracing

log = get_logger(__name__)
#: How long a service gets to stop cleanly after SIGTERM (the stack waits 15 s, then kills).
SHUTDOWN_GRACE_S = 10.0
#: How long a stopping service may spend exporting its last spans.
TRACE_FLUSH_S = 3.0


async def connect_service(service: str, common: CommonSettings) -> nats.NATS:
    """Connect to NATS (retrying until it answers) and make sure every stream exists."""
    nc = await bus.connect(common, name=f"artery-{service}")
    # Only when something is missing: checking needs STREAM.INFO, which every NATS role may
    # call, while creating or updating streams is the admin's (see shared/permissions.py).
    await provision_if_missing(nc.jetstream(), common)
    return nc


def run_service(
    service: str,
    start: Callable[[CommonSettings, asyncio.Event], Awaitable[None]],
) -> None:
    """Read the common settings, set up logs and traces, run ``start`` until SIGTERM/SIGINT."""
    common = load(CommonSettings, "ARTERY_")
    setup_logging(service, common.log_level, common.log_format)
    start_metrics_server(service)  # /metrics; its URL goes on every log line (``ready`` too)
    setup_tracing(service, common.otel_endpoint)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        log.info("starting", nats_url=common.nats_url)
        service = asyncio.create_task(start(common, stop))
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait({service, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not service.done():
            # Stop was asked for: the service shuts down cleanly on its own, unless it is still
            # starting (waiting for NATS or PostgreSQL that may never come): then it is cancelled.
            try:
                await asyncio.wait_for(service, timeout=SHUTDOWN_GRACE_S)
            except TimeoutError:
                log.warning("did not stop in time; cancelled", grace_s=SHUTDOWN_GRACE_S)
                return
        stopping.cancel()
        service.result()  # a failed start exits non-zero with its traceback
        log.info("stopped")

    try:
        asyncio.run(main())
    finally:
        # Spans wait in a batch for up to 5 s: export them before the process is gone (within
        # TRACE_FLUSH_S: the stack kills a service SHUTDOWN_GRACE_S + 5 s after asking it to stop).
        shutdown_tracing(TRACE_FLUSH_S)
