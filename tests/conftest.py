"""Real servers for the tests: a private nats-server per test and one PostgreSQL per session
(a fresh database per test), each on a free port under a temporary directory.

Servers and services run in sessions of their own, so nothing stops them when the suite ends but
the suite itself. Every process it starts inherits ``ARTERY_PROCESS_TAG``; one that still carries
the tag once the suite is over was leaked: it is named, killed, and the run fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import tempfile
import time
import uuid
from pathlib import Path

import asyncpg
import pytest

from artery.ops.stack import Stack
from artery.services.collector.service import Collector
from artery.services.collector.settings import CollectorSettings
from artery.shared import bus
from artery.shared.db import init_connection, migrate
from artery.shared.embedded import NatsServer, PostgresServer
from artery.shared.settings import CommonSettings
from tests.tiers import FAST_TIERS, SERVER_FIXTURES, SLOW_MODULES, TIER_OF_MODULE

# litellm would fetch its price map from the internet at import time.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

PROCESS_TAG = "ARTERY_PROCESS_TAG"
#: A process may still be on its way out when the suite ends (a killed postmaster's backends).
LEFTOVER_GRACE_S = 2.0


@pytest.hookimpl(tryfirst=True)  # before pytest's tmp_path plugin reads the option
def pytest_configure(config):
    """Temporary directories under a base of this run's own, not pytest's shared default.

    pytest takes group and other permissions away from ``/tmp/pytest-of-<user>`` at the start of
    every session. Run as root, PostgreSQL runs as another user that must traverse the path to its
    data directory (``embedded._open_prefix``): a second pytest session starting on the machine
    (CI's neighbour, ``make test-stress --load suite``) used to lock it out of a running cluster,
    which then died (``PANIC: could not open file ".../pg_control": Permission denied``)."""
    if config.option.basetemp is None and not hasattr(config, "workerinput"):
        config.option.basetemp = tempfile.mkdtemp(prefix="artery-tests-")
        config.artery_own_basetemp = True


def pytest_collection_modifyitems(config, items):
    """Each test gets its module's tier as a marker (``tests/tiers.py``; ``-m unit`` selects it).

    A test of a tier that runs without servers which asks for one is refused at collection: the
    table would be wrong, and ``make test-fast`` would start servers."""
    misplaced = []
    for item in items:
        tier = TIER_OF_MODULE.get(item.path.name)
        if tier is None:  # a module not in the table: test_tiers.py fails on it
            continue
        item.add_marker(getattr(pytest.mark, tier))
        if item.path.name in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
        if tier in FAST_TIERS and (servers := SERVER_FIXTURES.intersection(item.fixturenames)):
            misplaced.append(f"{item.nodeid} ({tier}) uses {', '.join(sorted(servers))}")
    if misplaced:
        listed = "\n".join(misplaced)
        raise pytest.UsageError(f"tests/tiers.py: these need servers, not their tier:\n{listed}")


#: How multiprocessing starts its resource tracker (the command line of that process).
RESOURCE_TRACKER = "from multiprocessing.resource_tracker import main"


def pytest_sessionstart(session):
    os.environ[PROCESS_TAG] = uuid.uuid4().hex


@pytest.hookimpl(trylast=True)  # after pytest's runner has torn down the session fixtures
def pytest_sessionfinish(session):
    tag = os.environ.get(PROCESS_TAG)
    if tag is None:
        return
    try:
        report_leftovers(session, tag)
    finally:
        remove_own_basetemp(session)


def remove_own_basetemp(session) -> None:
    """Our base directory goes once the run passed; after a failure it stays, logs and all."""
    if getattr(session.config, "artery_own_basetemp", False) and session.exitstatus == pytest.ExitCode.OK:
        shutil.rmtree(session.config.option.basetemp, ignore_errors=True)


def report_leftovers(session, tag: str) -> None:
    """Kill what still carries ``tag`` (after a grace for processes on their way out), say so,
    and fail the run."""
    leftovers = tagged_processes(tag)
    deadline = time.monotonic() + LEFTOVER_GRACE_S
    while leftovers and time.monotonic() < deadline:
        time.sleep(0.1)
        leftovers = tagged_processes(tag)
    if not leftovers:
        return
    lines = [f"{len(leftovers)} process(es) started by the tests outlived them, now killed:"]
    for pid, cmdline in leftovers.items():
        lines.append(f"  pid {pid}: {cmdline}")
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        print("\n".join(lines))
    else:
        reporter.write_line("")  # ends the progress line
        for line in lines:
            reporter.write_line(line, red=True)
    if session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def tagged_processes(tag: str) -> dict[int, str]:
    """pid -> command line of every other process whose environment carries ``tag``, except this
    interpreter's own resource tracker."""
    needle = f"{PROCESS_TAG}={tag}".encode()
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
                command = cmdline.decode(errors="replace").strip()
                if not _our_resource_tracker(entry, command):
                    found[int(entry.name)] = command
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def _our_resource_tracker(entry: Path, command: str) -> bool:
    """multiprocessing's resource tracker for this interpreter: its first ``spawn`` starts it
    (vLLM's engine core, started in-process by the GPU tests) and it ends when we do, after this
    check; no test started it, and no test can stop it."""
    if RESOURCE_TRACKER not in command:
        return False
    parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
    return parent == os.getpid()


@pytest.fixture
def single_torch_thread():
    """One torch thread, and PEFT's and transformers' advice about tiny models silenced: as fast
    on the tiny model, and steady when other processes share the cores (with two threads a busy
    machine made single steps 10-50x slower). Modules that train in this process use it."""
    import warnings

    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    torch.set_num_threads(threads)


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
        # As the service's runner: the durable consumer exists before the caller goes on (a test
        # asking for its info at once found none while ``run`` was still creating it).
        await collector.start()
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
