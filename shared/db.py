"""asyncpg pool and versioned migrations.

Migrations are the numbered ``migrations/NNNN_name.sql`` files, applied in order, each in its own
transaction, recorded in ``schema_migrations``. An advisory lock makes concurrent starts (several
collector replicas) apply each migration once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator
from importlib import resources

import asyncpg

from artery.shared.errors import DependencyUnavailable
from artery.shared.logs import get_logger

log = get_logger(__name__)

MIGRATION_LOCK_ID = 0x417274657279  # "Artery"

#: What a lost database connection looks like from asyncpg: a service retries later (nak with
#: delay, back off) and never dead-letters the message it was working on.
DATABASE_UNAVAILABLE: tuple[type[BaseException], ...] = (
    OSError,
    asyncpg.exceptions.ConnectionDoesNotExistError,
    asyncpg.exceptions.CannotConnectNowError,
    asyncpg.exceptions.InterfaceError,
    asyncpg.exceptions.AdminShutdownError,
    asyncpg.exceptions.CrashShutdownError,
    asyncpg.exceptions.ConnectionFailureError,
    asyncio.TimeoutError,
)
_NAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")


def migrations() -> list[tuple[int, str, str]]:
    """(version, name, sql) of every migration shipped with the package, in order."""
    found = []
    for entry in resources.files("artery.shared").joinpath("migrations").iterdir():
        match = _NAME.match(entry.name)
        if match:
            found.append((int(match.group(1)), match.group(2), entry.read_text()))
    return sorted(found)


async def migrate(conn: asyncpg.Connection) -> list[int]:
    """Apply what is missing; return the versions applied now."""
    applied_now = []
    await conn.execute("SELECT pg_advisory_lock($1)", MIGRATION_LOCK_ID)
    try:
        # Up to date: nothing to create. A service running as a least-privilege role (see
        # 0005_roles.sql) may not create tables, so it must not even try.
        if await conn.fetchval("SELECT to_regclass('schema_migrations')") is not None:
            done = {r["version"] for r in await conn.fetch("SELECT version FROM schema_migrations")}
            if {version for version, _, _ in migrations()} <= done:
                return []
        await conn.execute(
            "CREATE TABLE IF NOT EXISTS schema_migrations ("
            " version integer PRIMARY KEY, name text NOT NULL,"
            " applied_at timestamptz NOT NULL DEFAULT now())"
        )
        done = {r["version"] for r in await conn.fetch("SELECT version FROM schema_migrations")}
        for version, name, sql in migrations():
            if version in done:
                continue
            async with conn.transaction():
                await conn.execute(sql)
                await conn.execute(
                    "INSERT INTO schema_migrations (version, name) VALUES ($1, $2)", version, name
                )
            applied_now.append(version)
    finally:
        await conn.execute("SELECT pg_advisory_unlock($1)", MIGRATION_LOCK_ID)
    return applied_now


async def init_connection(conn: asyncpg.Connection) -> None:
    # jsonb as already-encoded JSON bytes: msgspec encodes, PostgreSQL stores, no dict round trip.
    # The binary format (a version byte, then the text) is what COPY needs.
    await conn.set_type_codec(
        "jsonb",
        schema="pg_catalog",
        format="binary",
        encoder=lambda value: b"\x01" + _json_bytes(value),
        decoder=lambda data: json.loads(data[1:]),
    )
    # json (what agents wrote, kept verbatim: see 0006_tenant_keys.sql) is its text, no version byte.
    await conn.set_type_codec(
        "json", schema="pg_catalog", format="binary", encoder=_json_bytes, decoder=json.loads
    )


def _json_bytes(value: object) -> bytes:
    return value if isinstance(value, bytes) else json.dumps(value).encode()


async def create_pool(dsn: str, *, min_size: int = 1, max_size: int = 4) -> asyncpg.Pool:
    return await asyncpg.create_pool(
        dsn, min_size=min_size, max_size=max_size, init=init_connection, command_timeout=30
    )


#: A connection in a state asyncpg cannot recover from (its protocol saw a connection cut
#: mid-operation): dropped from the pool, and the work retried like an outage.
_CONNECTION_LOST = (*DATABASE_UNAVAILABLE, asyncpg.exceptions.InternalClientError)


def _drop(conn: asyncpg.Connection, *, only_in_transaction: bool = False) -> None:
    """Terminate ``conn`` so the pool opens a fresh one, unless asyncpg already took it back (a
    connection the server closed is released by asyncpg itself)."""
    with contextlib.suppress(asyncpg.exceptions.InterfaceError):
        if not only_in_transaction or conn.is_in_transaction():
            conn.terminate()


async def _release(pool: asyncpg.Pool, conn: asyncpg.Connection) -> bool:
    """Hand ``conn`` back; False when its reset failed (asyncpg has terminated it then)."""
    try:
        await pool.release(conn)
        return True
    except Exception:
        return False


#: Errors of a PostgreSQL that is there but overloaded: retried like an outage, not blamed on
#: the message being handled.
_BUSY = frozenset({"TooManyConnectionsError", "QueryCanceledError"})


class ServicePool:
    """A service's connection pool, opened at first use (or by ``open``), whose failures are
    sorted for the consumer loop: PostgreSQL unreachable or busy raises ``DependencyUnavailable``
    (nak, back off, never dead-lettered), and every other error (a ``DataError`` about the data
    itself, say) passes through unchanged."""

    def __init__(self, dsn: str, *, max_size: int):
        self.dsn = dsn
        self.max_size = max_size
        self.pool: asyncpg.Pool | None = None
        self._lock = asyncio.Lock()  # concurrent first uses must not open two pools

    async def open(self) -> asyncpg.Pool:
        async with self._lock:
            if self.pool is None:
                self.pool = await create_pool(self.dsn, max_size=self.max_size)
        return self.pool

    @contextlib.asynccontextmanager
    async def connection(self) -> AsyncIterator[asyncpg.Connection]:
        """A connection of the pool for one unit of work, never shared with another coroutine.

        A connection that broke during the work (PostgreSQL stopped mid-transaction) is terminated
        rather than handed back: asyncpg's reset of such a connection is what raised
        ``InternalClientError: cannot switch to state ...; another operation is in progress``."""
        try:
            pool = await self.open()
            conn = await pool.acquire()
        except _CONNECTION_LOST as exc:
            raise DependencyUnavailable(f"PostgreSQL unavailable: {exc!r}") from exc
        try:
            yield conn
        except _CONNECTION_LOST as exc:
            _drop(conn)
            raise DependencyUnavailable(f"PostgreSQL unavailable: {exc!r}") from exc
        except asyncpg.exceptions.PostgresError as exc:
            if type(exc).__name__ in _BUSY:
                raise DependencyUnavailable(f"PostgreSQL busy: {exc!r}") from exc
            raise
        except BaseException:
            _drop(conn, only_in_transaction=True)  # cancelled mid-transaction: nothing to salvage
            raise
        finally:
            if not await _release(pool, conn):
                log.warning("a PostgreSQL connection could not be reset after its work; it was dropped")

    async def close(self) -> None:
        if self.pool is not None:
            await self.pool.close()


async def migrate_when_ready(dsn: str, *, attempts: int = 60, delay_s: float = 1.0) -> None:
    """Wait for PostgreSQL to accept connections (it may start after us), then migrate."""
    for attempt in range(1, attempts + 1):
        try:
            conn = await asyncpg.connect(dsn, timeout=5)
        except (OSError, asyncpg.exceptions.CannotConnectNowError) as exc:
            if attempt == attempts:
                raise
            log.warning("waiting for PostgreSQL", attempt=attempt, error=repr(exc))
            await asyncio.sleep(delay_s)
            continue
        try:
            applied = await migrate(conn)
            if applied:
                log.info("migrated", versions=applied)
            return
        finally:
            await conn.close()
