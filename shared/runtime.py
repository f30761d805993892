"""What every service's ``main`` does: settings, logs, traces, metrics, health, NATS, streams,
signals.

Health (``shared.health``): the process is ready once it logs ``ready`` and stops being ready as
soon as it is asked to stop; ``/readyz`` on the metrics server and the NATS service
``artery-<service>`` (on the connection ``connect_service`` made) follow that.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import uuid
from collections.abc import Callable, Coroutine
from typing import Any, NoReturn

import nats
import structlog

from artery.shared import bus, subjects
from artery.shared.errors import ConfigError
from artery.shared.health import HEALTH, NatsReadiness, note_log_event
from artery.shared.lifeline import watch_parent
from artery.shared.logs import get_logger, setup_logging
from artery.shared.metrics import start_metrics_server
from artery.shared.permissions import provision_if_missing
from artery.shared.settings import CommonSettings, load
from artery.shared.tasks import cancel_and_wait
from artery.shared.tracing import setup_tracing, shutdown_tracing

log = get_logger(__name__)
#: How long a service gets to stop cleanly after SIGTERM (the stack waits 15 s, then kills).
SHUTDOWN_GRACE_S = 10.0
#: How long a stopping service may spend exporting its last spans.
TRACE_FLUSH_S = 3.0
#: The exit status of a service refused an invalid setting (a crash exits 1).
CONFIG_EXIT_STATUS = 2
#: This process among every process that ever ran: its NATS readiness ping carries it, so a peer
#: can tell a live process from a dead one even where pids and addresses repeat (in Kubernetes
#: every container's service may be pid 1 on 0.0.0.0:9464).
INSTANCE_ID = uuid.uuid4().hex
#: The connection ``connect_service`` made, by service: the NATS readiness service answers on it.
_connections: dict[str, nats.NATS] = {}


async def connect_service(service: str, common: CommonSettings) -> nats.NATS:
    """Connect to NATS (retrying until it answers) and make sure every stream exists."""
    nc = await bus.connect(common, name=f"artery-{service}")
    # Only when something is missing: checking needs STREAM.INFO, which every NATS role may
    # call, while creating or updating streams is the admin's (see shared/permissions.py).
    await provision_if_missing(nc.jetstream(), common)
    _connections[service] = nc
    return nc


def _watch_ready_line() -> None:
    """Mark the process ready when it logs ``ready``: seen by the logger's ``info`` itself, so
    that a log level that filters the line out (``ARTERY_LOG_LEVEL=warning``) changes nothing."""
    base: Any = structlog.get_config()["wrapper_class"]  # whichever class logging set up
    if getattr(base, "watches_ready", False):
        return

    class WatchingReady(base):
        watches_ready = True

        def info(self, event=None, *args, **kw):
            note_log_event(event)
            return super().info(event, *args, **kw)

    structlog.configure(wrapper_class=WatchingReady)


async def _announce_when_ready(service: str, metrics_url: str | None) -> NatsReadiness | None:
    """Once ready, answer NATS readiness requests as ``artery-<service>`` (until stopping)."""
    became_ready = asyncio.Event()
    loop = asyncio.get_running_loop()
    HEALTH.on_ready(lambda: loop.call_soon_threadsafe(became_ready.set))
    await became_ready.wait()
    nc = _connections.get(service)
    if nc is None or HEALTH.stopping:
        return None
    metadata = {"service": service, "pid": str(os.getpid()), "instance": INSTANCE_ID}
    if metrics_url:
        metadata["metrics_url"] = metrics_url
    readiness = NatsReadiness(nc, subjects.HEALTH_SERVICE.format(service=service), metadata)
    try:
        await readiness.start()
    except Exception as exc:  # e.g. a role without the permission: HTTP /readyz still answers
        log.warning("NATS readiness service not started", error=repr(exc))
        return None
    return readiness


async def _stop_announcing(announcing: asyncio.Task) -> None:
    if not announcing.done():
        await cancel_and_wait(announcing)
        return
    readiness = announcing.result() if not announcing.cancelled() else None
    if readiness is not None:
        await readiness.stop()


def _refuse(exc: ConfigError) -> NoReturn:
    """End the process over an invalid setting: nothing to debug in a traceback, only the setting
    to fix, said once."""
    log.error("invalid settings", error=str(exc))
    raise SystemExit(CONFIG_EXIT_STATUS) from None


def run_service(
    service: str,
    start: Callable[[CommonSettings, asyncio.Event], Coroutine[Any, Any, None]],
) -> None:
    """Read the common settings, set up logs and traces, run ``start`` until SIGTERM/SIGINT.

    ``start`` reads its service's settings first, before it imports anything heavy (torch): an
    invalid setting ends the process at once with exit status 2, the variable named.
    """
    try:
        common = load(CommonSettings, "ARTERY_")
    except ConfigError as exc:  # no logging yet (its format is one of these settings)
        print(f"artery-{service}: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(CONFIG_EXIT_STATUS) from None
    setup_logging(service, common.log_level, common.log_format)
    watch_parent(log.warning)  # started by a stack: stop once the program that started it is gone
    _watch_ready_line()
    # /metrics, /healthz, /readyz; its URL goes on every log line (``ready`` too)
    try:
        metrics_url = start_metrics_server(service)
    except ConfigError as exc:
        _refuse(exc)
    setup_tracing(service, common.otel_endpoint)

    name = service

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        log.info("starting", nats_url=common.nats_url)
        announcing = asyncio.create_task(_announce_when_ready(name, metrics_url))
        service = asyncio.create_task(start(common, stop))
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait({service, stopping}, return_when=asyncio.FIRST_COMPLETED)
        # Not ready from here on: /readyz says 503 and NATS readiness requests go unanswered
        # while the service drains (the service itself sees ``stop`` at the same moment).
        HEALTH.mark_stopping()
        await _stop_announcing(announcing)
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
    except ConfigError as exc:
        _refuse(exc)
    finally:
        # Spans wait in a batch for up to 5 s: export them before the process is gone (within
        # TRACE_FLUSH_S: the stack kills a service SHUTDOWN_GRACE_S + 5 s after asking it to stop).
        shutdown_tracing(TRACE_FLUSH_S)
