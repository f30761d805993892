"""Entry point: ``python -m artery.services.console``. Settings are validated before connecting.

Reads PostgreSQL (as any role with SELECT, e.g. ``artery_reader``) and NATS (as the read-only
``console`` user in a secure stack); writes nothing. Its actions use the asker's admin credential.
Logs ``ready`` with its ``url`` once it listens (``artery up`` and ``LocalBackend`` print it).
"""

from __future__ import annotations

import asyncio

from artery.services.console.settings import PREFIX, ConsoleSettings
from artery.shared import bus
from artery.shared.db import DATABASE_UNAVAILABLE, create_pool
from artery.shared.errors import ConfigError
from artery.shared.http import serve_http, stop_http
from artery.shared.logs import get_logger
from artery.shared.runtime import connect_service, run_service
from artery.shared.settings import CommonSettings, load

log = get_logger(__name__)


async def _pool_when_ready(dsn: str, attempts: int = 60, delay_s: float = 1.0):
    for attempt in range(attempts):
        try:
            return await create_pool(dsn, min_size=1, max_size=4)
        except DATABASE_UNAVAILABLE as exc:
            if attempt == attempts - 1:
                raise
            log.warning("database not ready; retrying", error=str(exc))
            await asyncio.sleep(delay_s)
    raise AssertionError("unreachable")


async def start(common: CommonSettings, stop: asyncio.Event) -> None:
    settings = load(ConsoleSettings, PREFIX)
    if not common.database_url:
        raise ConfigError("the console needs ARTERY_DATABASE_URL")
    # The web stack is imported only once the settings are known to be valid.
    from artery.services.console.app import Sources, create_app

    nc = await connect_service("console", common)
    pool = await _pool_when_ready(common.database_url)
    app = create_app(Sources(pool=pool, nc=nc, settings=settings, common=common))
    server, task, port = await serve_http(app, settings.host, settings.port)
    url = f"http://{settings.host}:{port}"
    log.info("ready", url=url)
    await stop.wait()
    await stop_http(server, task)
    await pool.close()
    await bus.close(nc)


def main() -> None:
    run_service("console", start)


if __name__ == "__main__":
    main()
