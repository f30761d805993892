"""The life of a service that consumes durable streams and keeps rows in PostgreSQL.

Collector, reward, trainer and publisher all: connect, migrate, build the service, start its
consumers (and any companion that answers requests beside them), log ``ready`` (what the stack
waits for), run until asked to stop, then stop, drain and close in the reverse order. Each
``main.py`` says only what is its own: its settings, how to build the service, what ``ready``
reports. ``shared.runtime.run_service`` drives this from the process's signals.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from nats.aio.client import Client as NATS

from artery.shared import bus
from artery.shared.consumer import ConsumingService
from artery.shared.db import migrate_when_ready
from artery.shared.errors import ConfigError
from artery.shared.logs import get_logger
from artery.shared.runtime import connect_service
from artery.shared.settings import CommonSettings

log = get_logger(__name__)
S = TypeVar("S", bound=ConsumingService)


class Companion(Protocol):
    """Something started after the service's consumers and stopped before them (e.g. the
    publisher's retention requests), so that it never meets a service that is not running."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


async def serve_consumers(
    name: str,
    common: CommonSettings,
    stop: asyncio.Event,
    build: Callable[[NATS, str], S],
    *,
    companions: Callable[[NATS, S], Sequence[Companion]] = lambda nc, service: (),
    title: str | None = None,
    **ready: Any,
) -> None:
    """Run the service ``build(nc, database_url)`` until ``stop`` is set.

    ``title`` names the service in the one configuration error (default: ``name``); ``ready``
    goes on the ``ready`` log line (where a reader of the log learns what it runs with).
    """
    if not common.database_url:
        raise ConfigError(f"the {title or name} needs ARTERY_DATABASE_URL")
    nc = await connect_service(name, common)
    await migrate_when_ready(common.database_url)
    service = build(nc, common.database_url)
    extras = list(companions(nc, service))
    await service.start()
    for extra in extras:
        await extra.start()
    log.info("ready", **ready)
    task = asyncio.create_task(service.run())
    stopping = asyncio.create_task(stop.wait())
    # The consume loops end only when asked; one that ends first (a bug, an error nobody caught)
    # must end the process rather than leave it answering /readyz with nothing consumed, so that
    # its supervisor (compose's restart policy, `artery up`) sees it and starts it again.
    await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    for extra in reversed(extras):
        await extra.stop()
    service.stop()
    crashed = not stop.is_set()
    try:
        await task
    finally:
        await service.close()
        await bus.close(nc)
    if crashed:
        raise RuntimeError(f"the {title or name}'s consumers stopped without being asked to")
