"""PostgreSQL stopped for ten seconds mid-work, then started again, under every service that writes.

Each service runs in-process and is never restarted: it must treat the outage as an outage (nak
with a delay and back off; never dead-letter, never count it as a poison message: ``max_deliveries``
is set to 3 here, far below the redeliveries ten seconds bring), and finish every piece of work
exactly once when PostgreSQL is back. The collector's version is
``test_collector_faults.py::test_postgres_down_mid_ingest_loses_nothing``.
"""

from __future__ import annotations

import asyncio
import threading
import time

import asyncpg
import msgspec
import pytest

from artery.schemas import (
    CheckpointSaved,
    GroupReady,
    Message,
    ModelRecord,
    TrainCompleted,
    TrainRequested,
    Trajectory,
    TrajectoryGroupSubmitted,
    new_event_id,
)
from artery.services.collector.service import ready_event_id
from artery.services.collector.store import StoredGroup, write_groups
from artery.services.publisher import service as publisher_service
from artery.services.publisher.service import Publisher, object_name
from artery.services.publisher.settings import PublisherSettings
from artery.services.reward.service import RewardService
from artery.services.reward.settings import RewardSettings
from artery.shared import object_store, subjects
from artery.shared.bus import publish_event
from artery.shared.db import init_connection
from artery.shared.embedded import PostgresServer
from artery.testing.judge import serve_scripted_judge
from tests.factories import register_trainable
from tests.helpers import wait_for
from tests.test_publisher import messages_on, saved_event, settled, write_adapter
from tests.test_reward_service import by_content, ruler_group

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

PROJECT, MODEL = "demo", "agent"
OUTAGE_S = 10.0
MAX_DELIVERIES = 3  # an outage counted as failures would dead-letter within ten seconds


class Outage:
    """PostgreSQL taken away (fast shutdown: connections cut mid-transaction) and brought back."""

    def __init__(self, server: PostgresServer):
        self.server = server
        self.began: float | None = None
        self.ended: float | None = None
        self.began_event = threading.Event()

    def begin(self) -> None:
        self.server.stop()
        self.began = time.monotonic()
        self.began_event.set()

    async def end(self, after_s: float = OUTAGE_S) -> None:
        """Start PostgreSQL again ``after_s`` seconds after it went away."""
        await asyncio.to_thread(self.began_event.wait, 60)
        await asyncio.sleep(max(0.0, self.began + after_s - time.monotonic()))
        self.server.start()
        self.ended = time.monotonic()

    @property
    def length_s(self) -> float:
        return self.ended - self.began

    def since_end(self) -> float:
        return time.monotonic() - self.ended


async def connect(dsn: str) -> asyncpg.Connection:
    conn = await asyncpg.connect(dsn)
    await init_connection(conn)
    return conn


async def on_subject(js, stream: str, subject: str) -> int:
    info = await js.stream_info(stream, subjects_filter=subject)
    return (info.state.subjects or {}).get(subject, 0)


async def dead_letters(js) -> int:
    return (await js.stream_info(subjects.DLQ.name)).state.messages


# --------------------------------------------------------------------------- reward


async def test_reward_service_waits_out_postgres_and_judges_each_group_once(
    nc, js, run_collector, pg_server, database_url
):
    """Groups are being judged when PostgreSQL goes away (their verdicts cannot be stored yet) and
    more ``group.ready`` arrive during the outage; afterwards each group has one verdict, one
    ``group.scored``, and the judge was called once per group."""
    in_flight, arriving = 12, 8
    gate = threading.Event()
    score = by_content(0.2, 0.8)

    def held_answer(body: dict) -> str:  # the judge answers once the outage has begun
        gate.wait(30)
        return score(body)

    with serve_scripted_judge() as judge:
        judge.answers = [held_answer]
        await run_collector()
        settings = RewardSettings(
            judge_model="openai/judge",
            judge_api_base=judge.api_base,
            judge_api_key="x",
            fetch_timeout_s=0.05,
            backoff_max_s=2.0,
            max_deliveries=MAX_DELIVERIES,
        )
        service = RewardService(nc, database_url, settings)
        await service.start()
        task = asyncio.create_task(service.run())
        outage = Outage(pg_server)
        conn = await connect(database_url)
        try:
            # Stored by the collector (group.ready on its way to the reward service) ...
            judged = [ruler_group(size=2, seed=i) for i in range(in_flight)]
            for g in judged:
                await publish_event(js, subjects.trajectories(PROJECT, MODEL), g)
            # ... and stored just before the outage, their group.ready still to come.
            late = [ruler_group(size=2, seed=100 + i) for i in range(arriving)]
            await write_groups(conn, [StoredGroup.of(g, None) for g in late])

            async def judging_started():
                stored = await conn.fetchval("SELECT count(*) FROM trajectory_groups")
                return stored == in_flight + arriving and len(judge.requests) >= 1

            await wait_for(judging_started, timeout=30)
            await conn.close()
            outage.begin()
            gate.set()  # verdicts come back while they cannot be stored
            for g in late:
                ready = GroupReady(
                    id=ready_event_id(PROJECT, MODEL, g.id), project=PROJECT, model=MODEL, group_id=g.id,
                    num_trajectories=2, rewards=[t.reward for t in g.trajectories], needs_reward=True,
                )  # fmt: skip
                await publish_event(js, subjects.group_ready(PROJECT, MODEL), ready)
            await outage.end()
            conn = await connect(database_url)

            async def all_scored():
                return await conn.fetchval("SELECT count(*) FROM group_rewards") == in_flight + arriving

            await wait_for(all_scored, timeout=60)
            recovered_s = outage.since_end()
            total = in_flight + arriving
            assert await conn.fetchval("SELECT count(*) FROM group_rewards WHERE error IS NULL") == total
            assert await conn.fetchval("SELECT count(*) FROM trajectory_rewards") == 2 * total
            assert len(judge.requests) == total, "a group was judged twice"

            async def announced():
                return await on_subject(js, subjects.GROUPS.name, subjects.group_scored(PROJECT, MODEL))

            await wait_for(lambda: _equals(announced, total), timeout=30)
            await asyncio.sleep(0.5)
            assert await announced() == total
            assert await dead_letters(js) == 0
            assert service.consumer.stats.retried > 0  # the outage was met, and waited out
            assert not task.done()
            print(
                f"\nreward: {total} groups ({in_flight} being judged, {arriving} arriving during a"
                f" {outage.length_s:.1f}s outage); {len(judge.requests)} judge calls; all scored"
                f" {recovered_s:.1f}s after PostgreSQL came back; {service.consumer.stats.retried} naks"
            )
        finally:
            gate.set()
            service.stop()
            await asyncio.wait_for(task, 10)
            await service.close()
            await conn.close()


async def _equals(count, n: int) -> bool:
    return await count() == n


# --------------------------------------------------------------------------- publisher


async def test_publisher_waits_out_postgres_and_stores_each_checkpoint_once(
    nc, js, pg_server, database_url, tmp_path, monkeypatch
):
    """PostgreSQL goes away right after step 2's adapter was put in the Object Store (before its
    row), and steps 3-6 arrive during the outage: afterwards one row, one object (put once) and one
    ``checkpoint.published`` per step."""
    outage = Outage(pg_server)
    puts: dict[str, int] = {}
    real_put = publisher_service.put_adapter

    real_write = object_store.write_object

    async def put_then_maybe_lose_postgres(js_, name, data, **options):
        result = await real_put(js_, name, data, **options)
        if name == object_name(PROJECT, MODEL, 2) and outage.began is None:
            await asyncio.to_thread(outage.begin)
        return result

    async def counted_write(js_, bucket, name, data, **options):  # what is written, not asked for
        puts[name] = puts.get(name, 0) + 1
        return await real_write(js_, bucket, name, data, **options)

    monkeypatch.setattr(publisher_service, "put_adapter", put_then_maybe_lose_postgres)
    monkeypatch.setattr(object_store, "write_object", counted_write)
    settings = PublisherSettings(
        fetch_timeout_s=0.05, backoff_max_s=2.0, keep_latest=10, max_deliveries=MAX_DELIVERIES
    )
    publisher = Publisher(nc, database_url, settings)
    await publisher.start()
    task = asyncio.create_task(publisher.run())
    steps = range(1, 7)
    saved: dict[int, tuple[CheckpointSaved, bytes]] = {}
    for step in steps:
        uri, data = write_adapter(tmp_path, step)
        saved[step] = (saved_event(uri, data, step, reward_mean=step / 10), data)
    conn = await connect(database_url)
    try:
        await publish_event(js, subjects.checkpoint("saved", PROJECT, MODEL), saved[1][0])
        await wait_for(
            lambda: conn.fetchval("SELECT count(*) = 1 FROM checkpoints WHERE published_at IS NOT NULL")
        )
        await conn.close()
        await publish_event(js, subjects.checkpoint("saved", PROJECT, MODEL), saved[2][0])
        await asyncio.to_thread(outage.began_event.wait, 30)
        for step in steps[2:]:  # arriving while PostgreSQL is down
            await publish_event(js, subjects.checkpoint("saved", PROJECT, MODEL), saved[step][0])
        await outage.end()
        conn = await connect(database_url)

        async def all_published():
            return await conn.fetchval(
                "SELECT count(*) FROM checkpoints WHERE published_at IS NOT NULL"
            ) == len(steps)

        await wait_for(all_published, timeout=60)
        recovered_s = outage.since_end()
        await wait_for(lambda: settled(js))
        rows = await conn.fetch("SELECT step, event_id, sha256 FROM checkpoints ORDER BY step")
        assert [(r["step"], r["event_id"], r["sha256"]) for r in rows] == [
            (step, saved[step][0].id, saved[step][0].sha256) for step in steps
        ]
        assert puts == {object_name(PROJECT, MODEL, step): 1 for step in steps}  # each put once
        bucket = await js.object_store(subjects.ADAPTERS_BUCKET)
        names = sorted(info.name for info in await bucket.list())
        assert names == [object_name(PROJECT, MODEL, step) for step in steps]
        for step in (2, 6):
            assert (await bucket.get(object_name(PROJECT, MODEL, step))).data == saved[step][1]
        assert await messages_on(js, subjects.checkpoint("published", PROJECT, MODEL)) == len(steps)
        assert await dead_letters(js) == 0
        assert publisher.consumer.stats.retried > 0
        assert not task.done()
        print(
            f"\npublisher: {len(steps)} checkpoints (4 arriving during a {outage.length_s:.1f}s"
            f" outage that began between step 2's put and its row); each object put once; all"
            f" published {recovered_s:.1f}s after PostgreSQL came back;"
            f" {publisher.consumer.stats.retried} naks"
        )
    finally:
        publisher.stop()
        await asyncio.wait_for(task, 10)
        await publisher.close()
        await conn.close()


# --------------------------------------------------------------------------- trainer


def text_group(seed: int) -> TrajectoryGroupSubmitted:
    """Plain-text rollouts (no sampled tokens: the chat template path) with different rewards."""
    return TrajectoryGroupSubmitted(
        id=new_event_id(),
        project=PROJECT,
        model=MODEL,
        trajectories=[
            Trajectory(
                messages=[
                    Message(role="user", content=f"Say something {seed}."),
                    Message(role="assistant", content="abc" * (i + 1), trainable=True),
                ],
                reward=i / 3,
            )
            for i in range(4)
        ],
    )


async def test_trainer_waits_out_postgres_and_trains_each_request_once(
    nc, js, db, pg_server, database_url, tmp_path, monkeypatch
):
    """PostgreSQL goes away right after request A's step was saved (before it is recorded in
    ``training_steps``), request B arrives during the outage and C just after it, while A and B
    wait out their back-off: afterwards each request trained once, and has one ``training_steps``
    row, one ``checkpoint.saved`` and one ``train.completed``, whatever order they ran in."""
    import torch

    from artery.services.trainer import step_files
    from artery.services.trainer.policy import Policy
    from artery.services.trainer.service import Trainer
    from artery.services.trainer.settings import TrainerSettings
    from artery.shared.models import TINY

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    outage = Outage(pg_server)
    trained: list[int] = []
    real_train_step, real_snapshot_step = Policy.train_step, step_files.snapshot_step

    def counting_train_step(self, groups, *args, **kwargs):
        trained.append(len(groups))
        return real_train_step(self, groups, *args, **kwargs)

    def save_then_maybe_lose_postgres(*args, **kwargs):
        files = real_snapshot_step(*args, **kwargs)
        if outage.began is None:
            outage.begin()  # (in the trainer's worker thread)
        return files

    monkeypatch.setattr(Policy, "train_step", counting_train_step)
    monkeypatch.setattr(step_files, "snapshot_step", save_then_maybe_lose_postgres)

    await register_trainable(js, PROJECT, MODEL, TINY)
    kv = await js.key_value(subjects.MODELS_BUCKET)
    groups = [text_group(seed) for seed in range(6)]
    await write_groups(db, [StoredGroup.of(g, None) for g in groups])
    await db.close()
    a = TrainRequested(id=new_event_id(), project=PROJECT, model=MODEL, group_ids=[g.id for g in groups[:2]])
    b = TrainRequested(id=new_event_id(), project=PROJECT, model=MODEL, group_ids=[g.id for g in groups[2:4]])
    c = TrainRequested(id=new_event_id(), project=PROJECT, model=MODEL, group_ids=[g.id for g in groups[4:]])

    trainer = Trainer(
        nc,
        database_url,
        TrainerSettings(checkpoint_dir=str(tmp_path / "ckpt"), max_seq_len=128, pause_timeout_s=1.0),
    )
    trainer.consumer.options.max_deliveries = MAX_DELIVERIES
    await trainer.start()
    task = asyncio.create_task(trainer.run())
    conn = None
    try:
        await publish_event(js, subjects.train("requested", PROJECT, MODEL), a)
        await asyncio.to_thread(outage.began_event.wait, 90)
        await publish_event(js, subjects.train("requested", PROJECT, MODEL), b)  # during the outage
        await outage.end()
        await publish_event(js, subjects.train("requested", PROJECT, MODEL), c)  # just after it
        conn = await connect(database_url)

        async def all_recorded():
            return await conn.fetchval("SELECT count(*) FROM training_steps") == 3

        await wait_for(all_recorded, timeout=60, interval=0.1)
        recovered_s = outage.since_end()
        completed_subject = subjects.train("completed", PROJECT, MODEL)
        await wait_for(lambda: _equals(lambda: on_subject(js, subjects.TRAINING.name, completed_subject), 3))
        rows = {
            r["request_id"]: r["step"]
            for r in await conn.fetch("SELECT request_id, step FROM training_steps")
        }
        assert sorted(rows.values()) == [1, 2, 3] and set(rows) == {a.id, b.id, c.id}
        assert trained == [2, 2, 2], f"train_step ran {len(trained)} times for 3 requests"
        assert (
            await on_subject(js, subjects.CHECKPOINTS.name, subjects.checkpoint("saved", PROJECT, MODEL)) == 3
        )
        assert await on_subject(js, subjects.TRAINING.name, subjects.train("failed", PROJECT, MODEL)) == 0
        completed = await _events(js, completed_subject, TrainCompleted, 3)
        assert {(e.request_id, e.step) for e in completed} == set(rows.items())
        entry = await kv.get(subjects.model_key(PROJECT, MODEL))
        assert msgspec.json.decode(entry.value, type=ModelRecord).step == 3
        assert await dead_letters(js) == 0
        assert trainer.consumer.stats.retried > 0
        assert not task.done()
        print(
            f"\ntrainer: 3 requests (A saved its step just as a {outage.length_s:.1f}s outage began,"
            f" B arrived during it, C after it); {len(trained)} train steps; steps {rows[a.id]} (A),"
            f" {rows[b.id]} (B), {rows[c.id]} (C) recorded {recovered_s:.1f}s after PostgreSQL came back;"
            f" {trainer.consumer.stats.retried} naks"
        )
    finally:
        torch.set_num_threads(threads)
        trainer.stop()
        await asyncio.wait_for(task, 30)
        await trainer.close()
        if conn is not None:
            await conn.close()


async def _events(js, subject: str, type_, count: int) -> list:
    sub = await js.subscribe(subject, ordered_consumer=True)
    try:
        return [msgspec.json.decode((await sub.next_msg(timeout=5)).data, type=type_) for _ in range(count)]
    finally:
        await sub.unsubscribe()


async def test_a_step_recorded_after_a_later_request_trained_is_not_trained_again(
    nc, js, db, database_url, tmp_path, monkeypatch
):
    """After an outage, redeliveries come back in any order: request A saved step 1 but could not
    record it, B trains step 2 first, then A is redelivered. A must be answered with its step 1
    (found on disk), not trained a second time on top of B."""
    import torch

    from artery.services.trainer import service as trainer_service
    from artery.services.trainer.policy import Policy
    from artery.services.trainer.service import Trainer
    from artery.services.trainer.settings import TrainerSettings
    from artery.shared.errors import DependencyUnavailable
    from artery.shared.models import TINY

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    trained: list[int] = []
    real_train_step, real_record_step = Policy.train_step, trainer_service.record_step
    lost: list[str] = []

    def counting_train_step(self, groups, *args, **kwargs):
        trained.append(len(groups))
        return real_train_step(self, groups, *args, **kwargs)

    async def record_step_losing_the_first(conn, **kwargs):
        if not lost:
            lost.append(kwargs["request_id"])
            raise DependencyUnavailable("PostgreSQL unavailable (simulated)")
        return await real_record_step(conn, **kwargs)

    monkeypatch.setattr(Policy, "train_step", counting_train_step)
    monkeypatch.setattr(trainer_service, "record_step", record_step_losing_the_first)
    await register_trainable(js, PROJECT, MODEL, TINY)
    groups = [text_group(seed) for seed in range(4)]
    await write_groups(db, [StoredGroup.of(g, None) for g in groups])
    a = TrainRequested(id=new_event_id(), project=PROJECT, model=MODEL, group_ids=[g.id for g in groups[:2]])
    b = TrainRequested(id=new_event_id(), project=PROJECT, model=MODEL, group_ids=[g.id for g in groups[2:]])
    trainer = Trainer(
        nc,
        database_url,
        TrainerSettings(checkpoint_dir=str(tmp_path / "ckpt"), max_seq_len=128, pause_timeout_s=1.0),
    )
    await trainer.start()
    try:
        with pytest.raises(DependencyUnavailable):
            await trainer.handle(a)
        assert (await trainer.handle(b)).step == 2
        assert (await trainer.handle(a)).step == 1  # the redelivery
        assert trained == [2, 2]
        rows = await db.fetch("SELECT request_id, step FROM training_steps ORDER BY step")
        assert [(r["request_id"], r["step"]) for r in rows] == [(a.id, 1), (b.id, 2)]
    finally:
        torch.set_num_threads(threads)
        await trainer.close()
