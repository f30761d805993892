"""A NATS node dies mid-run: three nats-servers on loopback, every stream at three replicas, a
collector ingesting a steady flow of trajectory groups, and the stream leader (the node the
collector and the publishing client are connected to) killed with SIGKILL; the node comes back
a few seconds later, or never (the cluster carries on with two of three).

What must hold: every published group is stored exactly once, ``group.ready`` is announced
exactly once per group, and the collector carries on by itself (same process, same task).

The publishing client retries a publish that fails while the stream elects a new leader, with
the same event id: JetStream drops the copy if the first attempt was stored after all. Neither
nats-py's ``publish`` nor the SDK's ``model.publish()`` retries by itself: during the election
the ack does not come (``NoStreamResponseError``), so a producer must publish again, with the
same id.
"""

from __future__ import annotations

import asyncio
import time

import nats.errors
import pytest
from nats.js.errors import ServiceUnavailableError

from artery.services.collector.service import Collector
from artery.services.collector.settings import CollectorSettings
from artery.shared import bus, subjects
from artery.shared.bus import publish_event
from artery.shared.settings import CommonSettings
from artery.testing.cluster import NatsCluster
from tests.factories import group
from tests.helpers import wait_for

pytestmark = [pytest.mark.timeout(150), pytest.mark.slow]

SUBJECT = subjects.trajectories("demo", "agent")
GROUPS, GROUP_SIZE, PER_TICK = 1200, 2, 10
KILL_AFTER_STORED = 300
RESTART_AFTER_S = 5.0


@pytest.fixture
def cluster(tmp_path):
    c = NatsCluster(tmp_path / "cluster", size=3).start()
    yield c
    c.stop()


async def stream_info_after_the_kill(js, name: str, timeout_s: float = 30.0):
    """A stream whose leader was on the dead node answers once its new leader is elected; a quiet
    one (the dead-letter stream) may take longer than the API's timeout to get there."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await js.stream_info(name)
        except (nats.errors.TimeoutError, ServiceUnavailableError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def provision_when_ready(settings: CommonSettings) -> None:
    """The JetStream API may answer "temporarily unavailable" for a moment after the cluster forms."""
    nc = await bus.connect(settings, name="provision")
    try:
        for attempt in range(50):
            try:
                await bus.provision(nc.jetstream(), settings)
                return
            except Exception:
                if attempt == 49:
                    raise
                await asyncio.sleep(0.2)
    finally:
        await nc.close()


class RetryingProducer:
    """Publishes each group until JetStream acks it, always with the group's own id."""

    def __init__(self, js):
        self.js = js
        self.failures: list[str] = []
        self.acked: dict[str, int] = {}  # group id -> stream sequence of the ack

    async def publish(self, g) -> None:
        while True:
            try:
                ack = await publish_event(self.js, SUBJECT, g, timeout=2.0)
                self.acked[g.id] = ack.seq
                return
            except Exception as exc:  # election under way, connection lost: same id again
                self.failures.append(type(exc).__name__)
                await asyncio.sleep(0.1)

    async def run(self, groups) -> None:
        for start in range(0, len(groups), PER_TICK):
            await asyncio.gather(*(self.publish(g) for g in groups[start : start + PER_TICK]))
            await asyncio.sleep(0.02)


@pytest.mark.parametrize("restart", [True, False], ids=["restarted", "left-dead"])
async def test_stream_leader_killed_mid_ingest_stores_every_group_exactly_once(
    cluster, database_url, db, restart
):
    settings = CommonSettings(nats_url=cluster.url, database_url=database_url, stream_replicas=3)
    await provision_when_ready(settings)

    admin = await bus.connect(settings, name="admin")
    admin_js = admin.jetstream()
    info = await admin_js.stream_info(subjects.TRAJECTORIES.name)
    assert info.config.num_replicas == 3 and len(info.cluster.replicas) == 2
    victim = cluster.node(info.cluster.leader)
    # Both clients know all three URLs and start on the victim, so the kill takes away the stream
    # leader and both connections at once.
    ordered = ",".join([victim.url, *(u for u in cluster.urls if u != victim.url)])
    pinned = CommonSettings(nats_url=ordered, database_url=database_url, stream_replicas=3)
    collector_nc = await bus.connect(pinned, name="collector", dont_randomize=True)
    producer_nc = await bus.connect(pinned, name="producer", dont_randomize=True)
    assert collector_nc.connected_url.port == victim.port == producer_nc.connected_url.port

    collector = Collector(
        collector_nc.jetstream(),
        database_url,
        CollectorSettings(batch_size=50, fetch_timeout_s=0.2, ack_wait_s=5.0, backoff_max_s=1.0),
    )
    await collector.start()
    collector_task = asyncio.create_task(collector.run())
    producer = RetryingProducer(producer_nc.jetstream())
    groups = [group(size=GROUP_SIZE, seed=i) for i in range(GROUPS)]
    producing = asyncio.create_task(producer.run(groups))

    async def stored() -> int:
        return await db.fetchval("SELECT count(*) FROM trajectory_groups")

    try:
        await wait_for(lambda: _at_least(stored, KILL_AFTER_STORED), timeout=60, interval=0.01)
        stored_at_kill = await stored()
        processed_at_kill = processed(collector)
        killed_at = time.monotonic()
        cluster.kill(victim.name)

        # The collector resumes by itself: rows keep arriving without anything being restarted.
        await wait_for(lambda: _at_least(stored, stored_at_kill + 50), timeout=60, interval=0.05)
        resumed_after_s = time.monotonic() - killed_at
        if restart:
            await asyncio.sleep(max(0.0, RESTART_AFTER_S - (time.monotonic() - killed_at)))
            cluster.restart(victim.name)
        await asyncio.wait_for(producing, 90)

        async def all_stored():
            return await stored() == GROUPS

        await wait_for(all_stored, timeout=60, interval=0.1)
        total_s = time.monotonic() - killed_at

        ids = [r["id"] for r in await db.fetch("SELECT id FROM trajectory_groups")]
        assert sorted(ids) == sorted(g.id for g in groups)  # all of them, each once
        assert await db.fetchval("SELECT count(*) FROM trajectories") == GROUPS * GROUP_SIZE
        assert await db.fetchval("SELECT count(DISTINCT (group_id, idx)) FROM trajectories") == (
            GROUPS * GROUP_SIZE
        )
        # Each group acked once. The agents' stream keeps JetStream's minimal de-duplication
        # window (StreamSpec.agent_written: one tenant must not suppress another's ids), so a
        # publish retried after it is stored twice there: PostgreSQL holds it once (above). Each
        # group.ready is stored once although redelivered batches announced again.
        assert len(producer.acked) == GROUPS and len(set(producer.acked.values())) == GROUPS
        trajectories = await stream_info_after_the_kill(admin_js, subjects.TRAJECTORIES.name)
        assert trajectories.state.messages >= GROUPS

        async def announced_once():
            ready = await stream_info_after_the_kill(admin_js, subjects.GROUPS.name)
            return ready.state.messages == GROUPS

        await wait_for(announced_once, timeout=30)
        assert (await stream_info_after_the_kill(admin_js, subjects.DLQ.name)).state.messages == 0

        # Same collector, same task: it reconnected and kept consuming.
        assert not collector_task.done()
        assert processed(collector) > processed_at_kill
        assert collector_nc.stats["reconnects"] >= 1 and producer_nc.stats["reconnects"] >= 1
        assert collector_nc.is_connected
        new_leader = (await stream_info_after_the_kill(admin_js, subjects.TRAJECTORIES.name)).cluster.leader
        print(
            f"\npublished {GROUPS} groups ({len(producer.failures)} failed publishes retried:"
            f" {sorted(set(producer.failures))}); stored {GROUPS}; killed leader {victim.name} at"
            f" {stored_at_kill} stored; new leader {new_leader}; collector storing again after"
            f" {resumed_after_s:.1f}s; node {'restarted' if restart else 'left dead'}; all stored"
            f" {total_s:.1f}s after the kill; collector naks {collector.consumer.stats.retried};"
            f" collector reconnects {collector_nc.stats['reconnects']}"
        )
    finally:
        collector.stop()
        await asyncio.wait_for(collector_task, 10)
        await collector.close()
        if not producing.done():
            producing.cancel()
        for nc in (collector_nc, producer_nc, admin):
            await nc.close()


def processed(collector: Collector) -> int:
    """Messages acked by all of the collector's fetch loops (it runs ``concurrency`` of them)."""
    return sum(consumer.stats.processed for consumer in collector.consumers)


async def _at_least(count, n: int):
    value = await count()
    return value >= n and value
