"""The services' shared pool sorts PostgreSQL's failures: outages and overload are retried later,
errors about the data pass through to the handler."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

from artery.services.collector.store import StoredGroup, write_groups
from artery.services.reward.store import Verdict, record_verdict
from artery.services.trainer.store import load_groups, stored_group_ids
from artery.shared.db import ServicePool
from artery.shared.embedded import free_port
from artery.shared.errors import DependencyUnavailable
from tests import factories


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


async def test_connections_cut_during_concurrent_work_only_ever_look_like_an_outage(database_url):
    """Two hundred units of work at once, each going through the collector's, the reward service's and
    the trainer's database code on a pool of four, while every connection is cut again and again
    (mid-query, mid-transaction). Each cut must surface as ``DependencyUnavailable`` (retried),
    never as asyncpg's "another operation is in progress" from a broken connection handed back to
    the pool, and every unit ends done exactly once."""
    pool = ServicePool(database_url, max_size=4)
    admin = await asyncpg.connect(database_url)
    groups = [factories.group(size=2, seed=i) for i in range(200)]
    verdict = Verdict("judge", None, 1, 10, 10, 0.0, [(0, 0.5, 0.5, 0.0, "ok"), (1, 0.7, 0.7, 0.0, "ok")])
    outages = 0

    async def unit(g) -> None:
        nonlocal outages
        while True:
            try:
                async with pool.connection() as conn:  # the collector's
                    await write_groups(conn, [StoredGroup.of(g, None)])
                async with pool.connection() as conn:  # the reward service's
                    await record_verdict(conn, (g.project, g.model, g.id), verdict, None)
                async with pool.connection() as conn:  # the trainer's
                    assert await stored_group_ids(conn, g.project, g.model, [g.id]) == {g.id}
                    assert len((await load_groups(conn, g.project, g.model, [g.id]))[0]) == 2
                return
            except DependencyUnavailable:
                outages += 1
                await asyncio.sleep(0.01)

    async def cut_connections(rounds: int = 300) -> int:
        cuts = 0
        for _ in range(rounds):
            cuts += await admin.fetchval(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
            await asyncio.sleep(0.01)
        return cuts

    cutter = asyncio.create_task(cut_connections())
    await asyncio.wait_for(asyncio.gather(*(unit(g) for g in groups)), 120)
    cuts = await cutter
    try:
        assert cuts > 0 and outages > 0  # the cuts were met, and waited out
        assert await admin.fetchval("SELECT count(*) FROM trajectory_groups") == len(groups)
        assert await admin.fetchval("SELECT count(*) FROM trajectories") == 2 * len(groups)
        assert await admin.fetchval("SELECT count(*) FROM group_rewards") == len(groups)
        assert await admin.fetchval("SELECT count(*) FROM trajectory_rewards") == 2 * len(groups)
        async with pool.connection() as conn:  # and the pool still serves
            assert await conn.fetchval("SELECT 1") == 1
    finally:
        await admin.close()
        await pool.close()
