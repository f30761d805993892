"""The services' shared pool sorts PostgreSQL's failures: outages and overload are retried later,
errors about the data pass through to the handler."""

from __future__ import annotations

import asyncpg
import pytest

from artery.shared.db import ServicePool
from artery.shared.embedded import free_port
from artery.shared.errors import DependencyUnavailable


async def test_busy_is_an_outage_and_data_errors_pass_through(database_url):
    pool = ServicePool(database_url, max_size=1)
    try:
        async with pool.connection() as conn:
            assert await conn.fetchval("SELECT 1") == 1
        with pytest.raises(DependencyUnavailable, match="busy"):
            async with pool.connection() as conn:
                await conn.execute("SET statement_timeout = 10")
                await conn.execute("SELECT pg_sleep(1)")  # cancelled: QueryCanceledError
        with pytest.raises(asyncpg.exceptions.DataError):
            async with pool.connection() as conn:
                await conn.fetchval("SELECT 1 / 0")
    finally:
        await pool.close()


async def test_unreachable_is_an_outage():
    pool = ServicePool(f"postgresql://nobody@127.0.0.1:{free_port()}/none", max_size=1)
    with pytest.raises(DependencyUnavailable, match="unavailable"):
        async with pool.connection():
            pass
    await pool.close()
