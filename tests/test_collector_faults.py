"""Exactly-once storage and dead letters, through real servers and a real collector process."""

from __future__ import annotations

import asyncio
import math

import asyncpg
import msgspec
import pytest

from artery.schemas import DeadLetter, Trajectory
from artery.shared import subjects
from artery.shared.bus import event_headers, publish_event, publish_events
from artery.shared.codec import MSGPACK, encode
from tests.factories import group
from tests.helpers import wait_for

SUBJECT = subjects.trajectories("demo", "agent")


async def counts(db) -> tuple[int, int]:
    groups = await db.fetchval("SELECT count(*) FROM trajectory_groups")
    trajectories = await db.fetchval("SELECT count(*) FROM trajectories")
    return groups, trajectories


async def test_group_published_twice_is_stored_once(js, db, run_collector):
    await run_collector()
    g = group(size=3)
    await publish_event(js, SUBJECT, g)
    # Agents' events carry no Nats-Msg-Id (bus.AGENT_SUBJECTS: the stream's window is shared by
    # every tenant), so both repeats are stored in the stream: PostgreSQL drops them.
    await publish_event(js, SUBJECT, g)
    await publish_event(js, SUBJECT, g, msg_id="another-id")
    info = await js.stream_info(subjects.TRAJECTORIES.name)
    assert info.state.messages == 3

    async def settled():
        ci = await js.consumer_info(subjects.TRAJECTORIES.name, subjects.COLLECTOR_CONSUMER)
        return ci.num_pending == 0 and ci.num_ack_pending == 0

    await wait_for(settled)
    assert await counts(db) == (1, 3)


async def test_collector_killed_mid_batch_stores_everything_exactly_once(js, db, stack):
    stack.extra_env["ARTERY_COLLECTOR_BATCH_SIZE"] = "50"
    # The killed process's unacked batch comes back after ack_wait: seconds, not the default 30.
    stack.extra_env["ARTERY_COLLECTOR_ACK_WAIT_S"] = "3"
    stack.start_service("collector")
    groups = [group(size=4, seed=i) for i in range(1500)]
    await publish_events(js, [(SUBJECT, g) for g in groups])

    async def some_stored():
        n = (await counts(db))[0]
        return 0 < n < len(groups) and n

    stored_before_kill = await wait_for(some_stored, interval=0.01)
    stack.kill_service("collector")  # SIGKILL: a batch may be half-done, acks unsent
    await asyncio.sleep(0.5)
    stack.start_service("collector")

    async def all_stored():
        return await counts(db) == (1500, 6000)

    await wait_for(all_stored, timeout=60)
    distinct = await db.fetchval("SELECT count(DISTINCT (group_id, idx)) FROM trajectories")
    assert distinct == 6000
    assert stored_before_kill < 1500
    assert (
        await db.fetchval(
            "SELECT count(*) FROM trajectory_groups WHERE id <> ALL($1::text[])", [g.id for g in groups]
        )
        == 0
    )


def _raw(payload: bytes, content_type: str = "application/json", msg_id: str = "x") -> dict:
    return {"Content-Type": content_type, "Nats-Msg-Id": msg_id}


async def test_bad_input_is_dead_lettered_with_reason_while_good_input_flows(js, db, run_collector):
    await run_collector(max_group_bytes=64 * 1024)
    dlq = await js.subscribe(subjects.dead_letter("collector"))
    good = [group(size=2, seed=i) for i in range(6)]

    def as_dict(g):
        return msgspec.to_builtins(g)

    nan_reward = as_dict(group(size=2, seed=100))
    nan_reward["trajectories"][1]["reward"] = math.nan
    inf_metric = as_dict(group(size=2, seed=101))
    inf_metric["trajectories"][0]["metrics"]["x"] = math.inf
    inf_metadata = as_dict(group(size=2, seed=107))
    inf_metadata["trajectories"][1]["metadata"] = {"temperature": -math.inf}  # jsonb would say null
    wrong_type = as_dict(group(size=2, seed=102))
    wrong_type["trajectories"][0]["reward"] = "high"
    empty = as_dict(group(size=1, seed=103))
    empty["trajectories"] = []
    unknown_tag = as_dict(group(size=1, seed=104))
    unknown_tag["event"] = "trajectory_group.v9"
    huge = group(size=1, seed=105)
    huge.trajectories[0].messages[0].content = "x" * 100_000
    mismatch = group(project="other", model="agent", size=1, seed=106)

    bad: list[tuple[str, bytes, str, str]] = [  # (subject, payload, content type, expected kind)
        (SUBJECT, b"{not json", "application/json", "decode"),
        (SUBJECT, b"\xc1\xc1\xc1", MSGPACK, "decode"),
        (SUBJECT, encode(wrong_type), "application/json", "validation"),
        (SUBJECT, msgspec.msgpack.encode(nan_reward), MSGPACK, "non_finite"),
        (SUBJECT, msgspec.msgpack.encode(inf_metric), MSGPACK, "non_finite"),
        (SUBJECT, msgspec.msgpack.encode(inf_metadata), MSGPACK, "non_finite"),
        (SUBJECT, encode(empty), "application/json", "validation"),
        (SUBJECT, encode(unknown_tag), "application/json", "validation"),
        (SUBJECT, encode(huge), "application/json", "too_large"),
        (SUBJECT, encode(mismatch), "application/json", "subject_mismatch"),
        (SUBJECT, encode(good[0]), "text/xml", "content_type"),
        (SUBJECT, b"", "application/json", "decode"),
    ]
    for i, (subject, payload, content_type, _) in enumerate(bad):
        await js.publish(subject, payload, headers=_raw(payload, content_type, f"bad-{i}"))
        # good input interleaved with the bad
        await js.publish(SUBJECT, encode(good[i % len(good)]), headers=event_headers(good[i % len(good)]))

    letters = []
    for _ in bad:
        msg = await dlq.next_msg(timeout=10)
        letters.append(msgspec.json.decode(msg.data, type=DeadLetter))
    by_id = {letter.original_id: letter for letter in letters}
    for i, (_, payload, content_type, kind) in enumerate(bad):
        letter = by_id[f"bad-{i}"] if f"bad-{i}" in by_id else None
        if letter is None:  # the id the payload itself claims takes precedence over the header
            letter = next(
                lt for lt in letters if lt.payload == payload[: len(lt.payload)] and lt.kind == kind
            )
        assert letter.kind == kind, (i, letter.reason)
        assert letter.reason and letter.service == "collector" and letter.subject == SUBJECT
        assert letter.content_type == content_type
    non_finite = {lt.reason for lt in letters if lt.kind == "non_finite"}
    assert any("reward is nan" in r for r in non_finite) and any(
        "metadata['temperature'] is -inf" in r for r in non_finite
    )
    reasons = {lt.kind: lt.reason for lt in letters}
    assert "bytes is more than the limit" in reasons["too_large"]

    async def good_stored():
        return (await counts(db))[0] == len(good)

    await wait_for(good_stored)
    dlq_info = await js.stream_info(subjects.DLQ.name)
    assert dlq_info.state.messages == len(bad)


@pytest.mark.timeout(120)
async def test_postgres_down_mid_ingest_loses_nothing(js, db, run_collector, pg_server, database_url):
    await run_collector(batch_size=20)
    groups = [group(size=2, seed=i) for i in range(600)]
    publisher = asyncio.create_task(_publish_slowly(js, groups))

    async def some_stored():
        return (await counts(db))[0] > 50

    await wait_for(some_stored)
    await db.close()
    pg_server.stop()  # connections cut mid-transaction
    await asyncio.sleep(3)
    pg_server.start()
    await publisher
    conn = await asyncpg.connect(database_url)

    async def all_stored():
        return await counts(conn) == (600, 1200)

    await wait_for(all_stored, timeout=60)
    assert (await js.stream_info(subjects.DLQ.name)).state.messages == 0
    await conn.close()


async def _publish_slowly(js, groups, per_batch: int = 30):
    for start in range(0, len(groups), per_batch):
        await publish_events(js, [(SUBJECT, g) for g in groups[start : start + per_batch]])
        await asyncio.sleep(0.05)


async def test_a_sampled_nul_character_is_stored_exactly(js, db, run_collector):
    """A model can sample U+0000; the trajectory is stored as sent (jsonb could not hold it)."""
    await run_collector()
    with_nul = group(size=2, seed=200)
    with_nul.trajectories[0].messages[2].content = "a\x00b"
    await publish_event(js, SUBJECT, with_nul)

    async def stored():
        return (await counts(db))[0] == 1

    await wait_for(stored)
    body = await db.fetchval(
        "SELECT body::text FROM trajectories WHERE group_id = $1 AND idx = 0", with_nul.id
    )
    assert msgspec.json.decode(body, type=Trajectory) == with_nul.trajectories[0]


async def test_a_group_postgres_rejects_is_dead_lettered_alone(js, db, run_collector, monkeypatch):
    """PostgreSQL refusing one group's content must not hold back the rest of its batch."""
    from artery.services.collector import service

    poison = group(size=2, seed=400)
    real_write = service.write_groups

    async def write_refusing_poison(conn, batch):
        if any(item.id == poison.id for item in batch):
            raise asyncpg.exceptions.DataError("invalid byte sequence for encoding UTF8")
        return await real_write(conn, batch)

    monkeypatch.setattr(service, "write_groups", write_refusing_poison)
    good = [group(size=2, seed=500 + i) for i in range(4)]
    await publish_events(js, [(SUBJECT, g) for g in [good[0], poison, *good[1:]]])
    await run_collector(batch_size=50, concurrency=1)

    async def stored():
        return (await counts(db))[0] == 4

    await wait_for(stored)
    dlq = subjects.DLQ.name

    async def dead_lettered():
        return (await js.stream_info(dlq)).state.messages == 1

    await wait_for(dead_lettered)
    letter = msgspec.json.decode((await js.get_msg(dlq, 1)).data, type=DeadLetter)
    assert letter.kind == "storage" and letter.original_id == poison.id
    assert "invalid byte sequence" in letter.reason
