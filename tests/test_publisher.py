"""The checkpoint publisher: retention by hand (pure), then through real nats-server and PostgreSQL."""

from __future__ import annotations

import asyncio
import math

import asyncpg
import msgspec
import pytest
from nats.js.errors import NotFoundError

from artery.schemas import (
    CheckpointDeleted,
    CheckpointPublished,
    CheckpointSaved,
    DeadLetter,
    RetentionApplied,
    RetentionRequested,
    new_event_id,
)
from artery.services.publisher.control import RetentionServer
from artery.services.publisher.files import adapter_path
from artery.services.publisher.retention import Checkpoint, RetentionPolicy, best_step, plan_retention
from artery.services.publisher.service import (
    Publisher,
    deleted_event_id,
    object_name,
    published_event_id,
)
from artery.services.publisher.settings import PREFIX, PublisherSettings
from artery.shared import subjects
from artery.shared.adapters import get_adapter, pack_adapter, sha256_hex
from artery.shared.bus import event_headers, publish_event
from artery.shared.codec import encode
from artery.shared.errors import ConfigError, InvalidMessage
from artery.shared.settings import load
from tests.factories import register_trainable
from tests.helpers import wait_for

PROJECT, MODEL = "demo", "agent"
SAVED = subjects.checkpoint("saved", PROJECT, MODEL)

# -- retention, by hand ------------------------------------------------------------------------


def ckpts(*metrics: dict, deleted: tuple[int, ...] = ()) -> list[Checkpoint]:
    """Steps 1, 2, ... with the given metrics."""
    return [Checkpoint(step, m, step in deleted) for step, m in enumerate(metrics, start=1)]


def test_keeps_latest_and_best_deletes_the_rest():
    history = ckpts({"r": 0.2}, {"r": 0.9}, {"r": 0.5}, {"r": 0.4})
    plan = plan_retention(history, RetentionPolicy(keep_latest=1, best_metric="r"))
    assert (plan.keep, plan.delete, plan.best) == ((2, 4), (1, 3), 2)


def test_min_mode_keeps_the_lowest():
    history = ckpts({"loss": 3.0}, {"loss": 1.0}, {"loss": 2.0}, {"loss": 4.0})
    plan = plan_retention(history, RetentionPolicy(keep_latest=1, best_metric="loss", best_mode="min"))
    assert (plan.keep, plan.delete, plan.best) == ((2, 4), (1, 3), 2)


def test_the_latest_is_never_deleted_even_when_worst_or_without_the_metric():
    assert plan_retention(ckpts({"r": 1.0}, {"r": 0.0}), RetentionPolicy(best_metric="r")).keep == (1, 2)
    plan = plan_retention(ckpts({"r": 0.5}, {"r": 0.7}, {}), RetentionPolicy(best_metric="r"))
    assert (plan.keep, plan.delete, plan.best) == ((2, 3), (1,), 2)


def test_steps_without_the_metric_or_non_finite_are_never_best():
    history = ckpts({"other": 9.0}, {"r": math.nan}, {"r": 0.1}, {"r": -math.inf}, {})
    plan = plan_retention(history, RetentionPolicy(best_metric="r", best_mode="min"))
    assert (plan.keep, plan.delete, plan.best) == ((3, 5), (1, 2, 4), 3)
    assert best_step(ckpts({}, {"x": 1.0}), "r") is None


def test_keep_latest_n_and_ties_and_no_metric():
    history = ckpts({"r": 0.9}, {"r": 0.3}, {"r": 0.9}, {"r": 0.1}, {"r": 0.2})
    # a tie is won by the later step (3, not 1); the best may already be among the latest
    assert plan_retention(history, RetentionPolicy(keep_latest=2, best_metric="r")).keep == (3, 4, 5)
    assert plan_retention(history, RetentionPolicy(keep_latest=3, best_metric="r")).delete == (1, 2)
    assert plan_retention(history, RetentionPolicy(keep_latest=1, best_metric=None)).keep == (5,)
    assert plan_retention(history, RetentionPolicy(keep_latest=9, best_metric="r")).delete == ()


def test_deleted_checkpoints_are_neither_kept_nor_deleted_again():
    history = ckpts({"r": 0.9}, {"r": 0.5}, {"r": 0.4}, {"r": 0.1}, deleted=(1, 3))
    plan = plan_retention(history, RetentionPolicy(best_metric="r"))
    assert (plan.keep, plan.delete, plan.best) == ((2, 4), (), 2)
    assert plan_retention([], RetentionPolicy()).keep == ()


def test_policy_refuses_to_keep_nothing():
    with pytest.raises(ValueError):
        RetentionPolicy(keep_latest=0)


def test_settings_from_the_environment():
    settings = load(PublisherSettings, PREFIX, {f"{PREFIX}KEEP_LATEST": "3", f"{PREFIX}BEST_MODE": "min"})
    assert settings.retention_policy() == RetentionPolicy(
        keep_latest=3, best_metric="reward_mean", best_mode="min"
    )
    off = load(PublisherSettings, PREFIX, {f"{PREFIX}BEST_METRIC": "none"})
    assert off.retention_policy().best_metric is None
    for bad in ({f"{PREFIX}KEEP_LATEST": "0"}, {f"{PREFIX}BEST_MODE": "median"}):
        with pytest.raises(ConfigError):
            load(PublisherSettings, PREFIX, bad)


def test_only_absolute_file_uris_are_accepted():
    assert str(adapter_path("file:///ckpt/a%20b/adapter.tar")) == "/ckpt/a b/adapter.tar"
    assert str(adapter_path("file://localhost/ckpt/adapter.tar")) == "/ckpt/adapter.tar"
    for uri in ("s3://bucket/adapter.tar", "/ckpt/adapter.tar", "file://other-host/x.tar", "file:rel.tar"):
        with pytest.raises(InvalidMessage):
            adapter_path(uri)


# -- through real servers ----------------------------------------------------------------------


def write_adapter(root, step: int, *, size: int = 300_000) -> tuple[str, bytes]:
    """A packed adapter for ``step`` as the trainer writes it; (file URI, the archive's bytes)."""
    adapter = root / f"{step:06d}" / "adapter"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text('{"r": 8, "peft_type": "LORA"}')
    (adapter / "adapter_model.safetensors").write_bytes(bytes([step % 256]) * size)
    data = pack_adapter(adapter)
    path = adapter.parent / "adapter.tar"
    path.write_bytes(data)
    return path.as_uri(), data


def saved_event(uri: str, data: bytes, step: int, **metrics: float) -> CheckpointSaved:
    return CheckpointSaved(
        id=new_event_id(),
        project=PROJECT,
        model=MODEL,
        step=step,
        uri=uri,
        sha256=sha256_hex(data),
        size_bytes=len(data),
        base_model="artery/tiny-random",
        metrics=metrics,
    )


def published_event(object_name: str, data: bytes, step: int, *, project=PROJECT, model=MODEL):
    """What the publisher announces once ``data`` is in the Object Store as ``object_name``."""
    return CheckpointPublished(
        id=new_event_id(),
        project=project,
        model=model,
        step=step,
        object_name=object_name,
        sha256=sha256_hex(data),
        size_bytes=len(data),
        base_model="artery/tiny-random",
        served_name=f"{model}@{step}",
    )


@pytest.fixture
async def run_publisher(nc, database_url):
    """An in-process publisher with its retention server (same code as main); stopped at teardown."""
    started: list[tuple[Publisher, RetentionServer, asyncio.Task]] = []

    async def start(**overrides) -> Publisher:
        settings = PublisherSettings(**{"fetch_timeout_s": 0.05, "backoff_max_s": 1.0, **overrides})
        publisher = Publisher(nc, database_url, settings)
        server = RetentionServer(nc, publisher)
        await publisher.start()
        await server.start()
        started.append((publisher, server, asyncio.create_task(publisher.run())))
        return publisher

    yield start
    for publisher, server, task in started:
        await server.stop()
        publisher.stop()
        await asyncio.wait_for(task, 10)
        await publisher.close()


async def settled(js) -> bool:
    info = await js.consumer_info(subjects.CHECKPOINTS.name, subjects.PUBLISHER_CONSUMER)
    return info.num_pending == 0 and info.num_ack_pending == 0


async def messages_on(js, subject: str) -> int:
    info = await js.stream_info(subjects.CHECKPOINTS.name, subjects_filter=subject)
    return (info.state.subjects or {}).get(subject, 0)


async def object_exists(js, name: str) -> bool:
    bucket = await js.object_store(subjects.ADAPTERS_BUCKET)
    try:
        await bucket.get_info(name)
    except NotFoundError:
        return False
    return True


async def test_saved_checkpoint_becomes_object_row_and_published_event(js, db, run_publisher, tmp_path):
    published = await js.subscribe(subjects.checkpoint("published", PROJECT, MODEL))
    await run_publisher()
    uri, data = write_adapter(tmp_path, 1)
    saved = saved_event(uri, data, 1, reward_mean=0.25)
    await publish_event(js, SAVED, saved)

    msg = await published.next_msg(timeout=15)
    event = msgspec.json.decode(msg.data, type=CheckpointPublished)
    assert event.id == published_event_id(saved.id)
    assert event.object_name == object_name(PROJECT, MODEL, 1) == "demo/agent/000001"
    assert (event.step, event.served_name, event.base_model) == (1, "agent@1", "artery/tiny-random")
    assert (event.sha256, event.size_bytes) == (saved.sha256, len(data))

    stored = await get_adapter(js, event.object_name)
    assert stored == data and sha256_hex(stored) == saved.sha256
    row = await db.fetchrow("SELECT * FROM checkpoints")
    assert (row["project"], row["model"], row["step"], row["event_id"]) == (PROJECT, MODEL, 1, saved.id)
    assert (row["object_name"], row["sha256"], row["size_bytes"]) == (
        event.object_name,
        saved.sha256,
        len(data),
    )
    assert row["metrics"] == {"reward_mean": 0.25} and row["deleted_at"] is None
    # The row is marked published right after the event goes out: the event can arrive first.
    await wait_for(lambda: db.fetchval("SELECT published_at IS NOT NULL FROM checkpoints"))
    assert await db.fetchval("SELECT base_model FROM models WHERE project = $1 AND name = $2", PROJECT, MODEL)


async def test_redelivered_or_duplicate_saved_publishes_nothing_new(js, db, run_publisher, tmp_path):
    await run_publisher()
    uri, data = write_adapter(tmp_path, 1)
    saved = saved_event(uri, data, 1)
    await publish_event(js, SAVED, saved)
    await wait_for(lambda: settled(js))
    await wait_for(lambda: db.fetchval("SELECT published_at IS NOT NULL FROM checkpoints"))
    first = await db.fetchrow("SELECT * FROM checkpoints")

    # The file is gone (the trainer cleaned up): a redelivery must not need it.
    (tmp_path / "000001" / "adapter.tar").unlink()
    await publish_event(js, SAVED, saved)  # same Nats-Msg-Id: JetStream drops it
    await publish_event(js, SAVED, saved, msg_id="redelivered")  # gets past JetStream: a redelivery
    same_bytes = msgspec.structs.replace(saved, id=new_event_id())  # another id for the same step
    await publish_event(js, SAVED, same_bytes)
    await wait_for(lambda: settled(js))

    assert await db.fetchval("SELECT count(*) FROM checkpoints") == 1
    assert await db.fetchrow("SELECT * FROM checkpoints") == first
    assert await messages_on(js, subjects.checkpoint("published", PROJECT, MODEL)) == 1
    assert (await js.stream_info(subjects.DLQ.name)).state.messages == 0

    # A crash after the row but before checkpoint.published was recorded: sent again, same id.
    await db.execute("UPDATE checkpoints SET published_at = NULL")
    await publish_event(js, SAVED, saved, msg_id="after-crash")
    await wait_for(lambda: db.fetchval("SELECT published_at IS NOT NULL FROM checkpoints"))
    await wait_for(lambda: settled(js))
    assert await messages_on(js, subjects.checkpoint("published", PROJECT, MODEL)) == 1


async def test_bad_checkpoints_are_dead_lettered_while_a_good_one_flows(js, db, run_publisher, tmp_path):
    dlq = await js.subscribe(subjects.dead_letter("publisher"))
    await run_publisher()
    uri, data = write_adapter(tmp_path, 1)
    good = saved_event(uri, data, 1)
    wrong_sha = msgspec.structs.replace(saved_event(uri, data, 2), sha256="0" * 64)
    missing = saved_event((tmp_path / "nowhere" / "adapter.tar").as_uri(), data, 3)
    not_file = saved_event("s3://bucket/adapter.tar", data, 4)
    other_uri, other = write_adapter(tmp_path, 5)
    conflict = saved_event(other_uri, other, 1)  # step 1 again, other bytes
    expected = {
        wrong_sha.id: ("sha256_mismatch", "sha256 is"),
        missing.id: ("not_found", "adapter file not found"),
        not_file.id: ("uri", "only file:// URIs are accepted"),
        conflict.id: ("step_conflict", "already published"),
    }
    for event in (wrong_sha, missing, good, not_file):
        await publish_event(js, SAVED, event)
    await wait_for(lambda: db.fetchval("SELECT count(*) FROM checkpoints WHERE published_at IS NOT NULL"))
    await publish_event(js, SAVED, conflict)
    garbage = b'{"event": "checkpoint.saved"'
    await js.publish(SAVED, garbage, headers={"Nats-Msg-Id": "garbage"})

    letters = [msgspec.json.decode((await dlq.next_msg(timeout=10)).data, type=DeadLetter) for _ in range(5)]
    by_id = {letter.original_id: letter for letter in letters}
    for event_id, (kind, reason) in expected.items():
        assert by_id[event_id].kind == kind, by_id[event_id]
        assert reason in by_id[event_id].reason
        assert by_id[event_id].service == "publisher" and by_id[event_id].subject == SAVED
    assert by_id["garbage"].kind == "decode" and by_id["garbage"].payload == garbage

    await wait_for(lambda: settled(js))
    rows = await db.fetch("SELECT step, event_id FROM checkpoints")
    assert [(r["step"], r["event_id"]) for r in rows] == [(1, good.id)]
    assert await get_adapter(js, object_name(PROJECT, MODEL, 1)) == data
    assert not await object_exists(js, object_name(PROJECT, MODEL, 2))
    assert (await js.stream_info(subjects.DLQ.name)).state.messages == 5


async def publish_steps(js, tmp_path, rewards: list[float]) -> list[CheckpointSaved]:
    events = []
    for step, reward in enumerate(rewards, start=1):
        uri, data = write_adapter(tmp_path, step)
        events.append(saved_event(uri, data, step, reward_mean=reward, loss=1.0 - reward))
        await publish_event(js, SAVED, events[-1])
    return events


async def test_retention_keeps_the_latest_and_the_best(js, db, run_publisher, tmp_path):
    deleted_sub = await js.subscribe(subjects.checkpoint("deleted", PROJECT, MODEL))
    await run_publisher(keep_latest=1, best_metric="reward_mean")
    events = await publish_steps(js, tmp_path, [0.2, 0.9, 0.5, 0.4])
    await wait_for(lambda: db.fetchval("SELECT count(*) = 4 FROM checkpoints WHERE published_at IS NOT NULL"))
    await wait_for(lambda: settled(js))

    deleted = [
        msgspec.json.decode((await deleted_sub.next_msg(timeout=10)).data, type=CheckpointDeleted)
        for _ in range(2)
    ]
    assert sorted(d.step for d in deleted) == [1, 3]
    for d in deleted:
        assert d.id == deleted_event_id(events[d.step - 1].id)
        assert d.object_name == object_name(PROJECT, MODEL, d.step) and d.reason == "retention"
    with pytest.raises(asyncio.TimeoutError):
        await deleted_sub.next_msg(timeout=0.5)
    for step, kept in ((1, False), (2, True), (3, False), (4, True)):
        assert await object_exists(js, object_name(PROJECT, MODEL, step)) is kept, step
    rows = await db.fetch("SELECT step, deleted_at IS NOT NULL AS gone FROM checkpoints ORDER BY step")
    assert [(r["step"], r["gone"]) for r in rows] == [(1, True), (2, False), (3, True), (4, False)]

    # A redelivery of a deleted step changes nothing: no object comes back, nothing is published.
    await publish_event(js, SAVED, events[0], msg_id="late-redelivery")
    await wait_for(lambda: settled(js))
    assert not await object_exists(js, object_name(PROJECT, MODEL, 1))
    assert await messages_on(js, subjects.checkpoint("published", PROJECT, MODEL)) == 4
    assert await messages_on(js, subjects.checkpoint("deleted", PROJECT, MODEL)) == 2


async def retain(nc, *, data: bytes | None = None, **fields) -> RetentionApplied:
    request = RetentionRequested(id=new_event_id(), project=PROJECT, model=MODEL, **fields)
    body = encode(request) if data is None else data
    msg = await nc.request(
        subjects.retention_request(PROJECT, MODEL), body, timeout=10, headers=event_headers(request)
    )
    return msgspec.json.decode(msg.data, type=RetentionApplied)


async def test_retain_request_applies_retention_and_replies(nc, js, db, run_publisher, tmp_path):
    dlq = await js.subscribe(subjects.dead_letter("publisher"))
    await run_publisher(keep_latest=10)  # nothing is deleted after each publish
    await publish_steps(js, tmp_path, [0.2, 0.9, 0.5, 0.4, 0.6])
    await wait_for(lambda: db.fetchval("SELECT count(*) = 5 FROM checkpoints WHERE published_at IS NOT NULL"))

    # ART's delete_checkpoints: the latest plus the best by a metric (here the lowest loss).
    reply = await retain(nc, keep_latest=1, best_metric="loss", best_mode="min")
    assert reply.error is None
    assert (reply.kept, reply.deleted, reply.best_step, reply.step) == ([2, 5], [1, 3, 4], 2, 5)
    for step in range(1, 6):
        assert await object_exists(js, object_name(PROJECT, MODEL, step)) is (step in (2, 5))
    assert await messages_on(js, subjects.checkpoint("deleted", PROJECT, MODEL)) == 3
    reasons = await db.fetch("SELECT DISTINCT deleted_reason FROM checkpoints WHERE deleted_at IS NOT NULL")
    assert [r["deleted_reason"] for r in reasons] == ["requested"]

    again = await retain(nc, keep_latest=1, best_metric=None)  # the best is not kept any more
    assert (again.kept, again.deleted, again.best_step) == ([5], [2], None)
    assert (await retain(nc, keep_latest=1, best_metric=None)).deleted == []
    assert await messages_on(js, subjects.checkpoint("deleted", PROJECT, MODEL)) == 4

    bad = await retain(nc, data=b'{"event": "checkpoint.retain", "keep_latest": 0}', best_metric=None)
    assert bad.error and bad.error.startswith("validation") and bad.deleted == []
    letter = msgspec.json.decode((await dlq.next_msg(timeout=10)).data, type=DeadLetter)
    assert (letter.kind, letter.project, letter.model, letter.service) == (
        "validation",
        PROJECT,
        MODEL,
        "publisher",
    )
    assert await object_exists(js, object_name(PROJECT, MODEL, 5))


async def test_retention_asked_right_after_a_step_waits_for_the_registrys_step(
    nc, js, db, run_publisher, tmp_path
):
    """``train()`` returns once replicas serve the step, which they may load from the trainer's
    store before the publisher has recorded it; the registry already names it. A retention asked
    then waits for that step and keeps it as the latest, instead of answering without it."""
    await run_publisher(keep_latest=10)
    await publish_steps(js, tmp_path, [0.2])
    await wait_for(lambda: db.fetchval("SELECT count(*) = 1 FROM checkpoints WHERE published_at IS NOT NULL"))
    await register_trainable(js, PROJECT, MODEL, "artery/tiny-random", step=2)  # the trainer moved it

    asked = asyncio.create_task(retain(nc, keep_latest=1, best_metric=None))
    done, _ = await asyncio.wait({asked}, timeout=0.5)
    assert not done, f"answered without the registry's step 2: {asked.result()}"
    uri, data = write_adapter(tmp_path, 2)
    await publish_event(js, SAVED, saved_event(uri, data, 2, reward_mean=0.5))
    reply = await asked
    assert reply.error is None
    assert (reply.step, reply.kept, reply.deleted) == (2, [2], [1])


@pytest.mark.timeout(120)
async def test_postgres_down_loses_nothing(js, db, run_publisher, pg_server, database_url, tmp_path):
    publisher = await run_publisher(keep_latest=10)
    uri, data = write_adapter(tmp_path, 1)
    await publish_event(js, SAVED, saved_event(uri, data, 1))
    await wait_for(lambda: db.fetchval("SELECT count(*) = 1 FROM checkpoints WHERE published_at IS NOT NULL"))
    await db.close()
    pg_server.stop()
    for step in (2, 3):
        uri, data = write_adapter(tmp_path, step)
        await publish_event(js, SAVED, saved_event(uri, data, step))
    await asyncio.sleep(2)
    pg_server.start()
    conn = await asyncpg.connect(database_url)
    try:

        async def all_published():
            return await conn.fetchval("SELECT count(*) = 3 FROM checkpoints WHERE published_at IS NOT NULL")

        await wait_for(all_published, timeout=60)
        await wait_for(lambda: settled(js))
        assert await messages_on(js, subjects.checkpoint("published", PROJECT, MODEL)) == 3
        assert (await js.stream_info(subjects.DLQ.name)).state.messages == 0
        assert publisher.consumer.stats.retried > 0  # the outage was met, and waited out
    finally:
        await conn.close()


async def test_publisher_process_is_ready_and_publishes(js, db, stack, tmp_path):
    stack.start_service("publisher").wait_ready()
    uri, data = write_adapter(tmp_path, 7)
    await publish_event(js, SAVED, saved_event(uri, data, 7, reward_mean=1.0))
    await wait_for(lambda: db.fetchval("SELECT published_at IS NOT NULL FROM checkpoints WHERE step = 7"))
    assert await get_adapter(js, object_name(PROJECT, MODEL, 7)) == data
