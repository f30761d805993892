"""Real servers for the tests: a private nats-server per test and one PostgreSQL per session
(a fresh database per test), each on a free port under a temporary directory."""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid

import asyncpg
import pytest

from artery.services.collector.service import Collector
from artery.services.collector.settings import CollectorSettings
from artery.shared import bus
from artery.shared.db import init_connection, migrate
from artery.shared.embedded import NatsServer, PostgresServer
from artery.shared.settings import CommonSettings
from artery.stack import Stack

# litellm would fetch its price map from the internet at import time.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")


@pytest.fixture(scope="session")
def pg_server(tmp_path_factory):
    server = PostgresServer(tmp_path_factory.mktemp("pg") / "data", durable=False).start()
    yield server
    server.stop()


@pytest.fixture
async def database_url(pg_server):
    name = f"t_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(pg_server.dsn())
    await admin.execute(f'CREATE DATABASE "{name}"')
    dsn = pg_server.dsn(name)
    conn = await asyncpg.connect(dsn)
    await migrate(conn)
    await conn.close()
    yield dsn
    if pg_server.proc is None:  # a test stopped the server: bring it back for the next one
        pg_server.start()
    await admin.close()
    admin = await asyncpg.connect(pg_server.dsn())
    await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    await admin.close()


@pytest.fixture
async def db(database_url):
    conn = await asyncpg.connect(database_url)
    await init_connection(conn)
    yield conn
    with contextlib.suppress(Exception):
        await conn.close()


@pytest.fixture
def nats_server(tmp_path):
    server = NatsServer(tmp_path / "nats").start()
    yield server
    server.stop()


@pytest.fixture
def common_settings(nats_server, database_url) -> CommonSettings:
    return CommonSettings(nats_url=nats_server.url, database_url=database_url)


@pytest.fixture
async def nc(nats_server, common_settings):
    client = await bus.connect(common_settings, name="test")
    await bus.provision(client.jetstream(), common_settings)
    yield client
    await client.close()


@pytest.fixture
async def js(nc):
    return nc.jetstream()


@pytest.fixture
async def run_collector(js, database_url):
    """Start an in-process collector (same code as the service's main); stopped at teardown."""
    started: list[tuple[Collector, asyncio.Task]] = []

    async def start(**overrides) -> Collector:
        settings = CollectorSettings(**{"fetch_timeout_s": 0.05, "backoff_max_s": 1.0, **overrides})
        collector = Collector(js, database_url, settings)
        started.append((collector, asyncio.create_task(collector.run())))
        return collector

    yield start
    for collector, task in started:
        collector.stop()
        await asyncio.wait_for(task, 10)
        await collector.close()


@pytest.fixture
def stack(tmp_path, nats_server, database_url):
    """Services as real child processes against the test's NATS and PostgreSQL."""
    s = Stack(home=tmp_path / "stack", nats_url=nats_server.url, database_url=database_url)
    s.start_infrastructure()
    yield s
    s.stop()
