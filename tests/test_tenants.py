"""Ids are the agents' own: a tenant (project, model) never loses, nor alters, another's data
through them. Against a real nats-server and PostgreSQL, with the real collector."""

from __future__ import annotations

import hashlib
import re

import msgspec
import pytest

from artery.schemas import DeadLetter, GroupReady, Trajectory
from artery.services.trainer.store import completed_step, record_step
from artery.shared import bus, subjects
from artery.shared.bus import MSG_ID, event_headers, publish_event
from artery.shared.codec import encode
from tests.factories import group
from tests.helpers import wait_for

A, B, MODEL = "alpha", "beta", "agent"


async def stored_groups(db) -> set[tuple[str, str, str]]:
    return {tuple(r) for r in await db.fetch("SELECT project, model, id FROM trajectory_groups")}


async def trajectories_of(db, project: str, group_id: str) -> list[Trajectory]:
    rows = await db.fetch(
        "SELECT body::text FROM trajectories"
        " WHERE project = $1 AND model = $2 AND group_id = $3 ORDER BY idx",
        project,
        MODEL,
        group_id,
    )
    return [msgspec.json.decode(row[0], type=Trajectory) for row in rows]


async def letters(js) -> list[DeadLetter]:
    info = await js.stream_info(subjects.DLQ.name)
    found = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1) if info.state.messages else ():
        found.append(msgspec.json.decode((await js.get_msg(subjects.DLQ.name, seq)).data, type=DeadLetter))
    return found


async def test_two_projects_store_and_announce_groups_under_the_same_id(js, db, run_collector):
    ready = await js.subscribe(subjects.group_ready("*", MODEL))
    await run_collector()
    mine, theirs = group(A, MODEL, size=2, seed=1), group(B, MODEL, size=3, seed=2)
    theirs.id = mine.id
    for g in (mine, theirs):  # the SDK's Nats-Msg-Id is scoped: <project>.<model>.<id>
        await publish_event(js, subjects.trajectories(g.project, g.model), g)

    async def both_stored():
        return await stored_groups(db) == {(A, MODEL, mine.id), (B, MODEL, mine.id)}

    await wait_for(both_stored)
    assert await trajectories_of(db, A, mine.id) == mine.trajectories
    assert await trajectories_of(db, B, mine.id) == theirs.trajectories
    announced = [
        msgspec.json.decode((await ready.next_msg(timeout=10)).data, type=GroupReady) for _ in range(2)
    ]
    assert sorted((r.project, r.group_id, r.num_trajectories) for r in announced) == [
        (A, mine.id, 2),
        (B, mine.id, 3),
    ]
    assert announced[0].id != announced[1].id  # derived from the key: neither is de-duplicated away
    assert await letters(js) == []


async def test_a_copied_msg_id_suppresses_nothing(js, db, run_collector):
    """B copies the exact Nats-Msg-Id A's group would once have had, at once. Agents' events
    carry no Nats-Msg-Id (``bus.AGENT_SUBJECTS``), so JetStream's window, shared by every tenant,
    has nothing of A's to drop: both groups are stored, each its own tenant's."""
    info = await js.stream_info(subjects.TRAJECTORIES.name)
    assert info.config.duplicate_window == bus.AGENT_DUPLICATE_WINDOW_S
    await run_collector()
    mine = group(A, MODEL, size=2, seed=3)
    subject = subjects.trajectories(A, MODEL)
    assert MSG_ID not in bus.prepare(subject, mine).headers
    theirs = group(B, MODEL, size=2, seed=4)
    forged = {**event_headers(theirs), MSG_ID: bus.tenant_msg_id(mine)}
    first = await js.publish(subjects.trajectories(B, MODEL), encode(theirs), headers=forged)
    again = await publish_event(js, subject, mine)
    assert not first.duplicate and not again.duplicate

    async def both_stored():
        return {(A, MODEL, mine.id), (B, MODEL, theirs.id)} <= await stored_groups(db)

    await wait_for(both_stored)
    assert await letters(js) == []


async def test_a_different_group_under_a_stored_id_is_a_conflict_and_a_redelivery_is_not(
    js, db, run_collector
):
    await run_collector()
    subject = subjects.trajectories(A, MODEL)
    first = group(A, MODEL, size=2, seed=5)
    first_bytes = encode(first)
    await js.publish(subject, first_bytes, headers={**event_headers(first), MSG_ID: "first"})

    async def stored():
        return (A, MODEL, first.id) in await stored_groups(db)

    await wait_for(stored)
    # The same bytes again under another Nats-Msg-Id (a publisher's retry): stored once, silently.
    await js.publish(subject, first_bytes, headers={**event_headers(first), MSG_ID: "retry"})
    changed = msgspec.structs.replace(first, metadata={"changed": True})
    await js.publish(subject, encode(changed), headers={**event_headers(changed), MSG_ID: "other"})

    async def lettered():
        return await letters(js)

    (letter,) = await wait_for(lettered)
    assert letter.kind == "conflict" and letter.original_id == first.id
    stored_hash, this_hash = re.search(
        r"stored body sha256 ([0-9a-f]{64}), this one ([0-9a-f]{64})", letter.reason
    ).groups()
    assert stored_hash == hashlib.sha256(first_bytes).hexdigest()
    assert this_hash == hashlib.sha256(encode(changed)).hexdigest()
    # The first is kept exactly; the retry wrote nothing.
    assert await trajectories_of(db, A, first.id) == first.trajectories
    assert await db.fetchval("SELECT metadata::text FROM trajectory_groups WHERE id = $1", first.id) == "{}"
    ci = await js.consumer_info(subjects.TRAJECTORIES.name, subjects.COLLECTOR_CONSUMER)
    assert ci.num_pending == 0 and ci.num_ack_pending == 0
    assert len(await letters(js)) == 1


@pytest.mark.parametrize("content_type", ["application/json", "application/msgpack"])
async def test_the_same_group_twice_in_one_batch_is_stored_once_and_a_changed_one_conflicts(
    js, db, run_collector, content_type
):
    """Published back to back (one batch): the first is the one kept."""
    subject = subjects.trajectories(A, MODEL)
    first = group(A, MODEL, size=2, seed=6)
    changed = msgspec.structs.replace(first, metadata={"changed": True})
    for i, g in enumerate((first, first, changed)):
        await js.publish(
            subject, encode(g, content_type), headers={**event_headers(g, content_type), MSG_ID: f"m{i}"}
        )
    await run_collector(batch_size=10)

    async def lettered():
        return await letters(js)

    (letter,) = await wait_for(lettered)
    assert letter.kind == "conflict"
    assert await trajectories_of(db, A, first.id) == first.trajectories


async def test_a_train_request_id_is_scoped_to_its_model(db):
    """The trainer's record of a request (a redelivery is answered from it) is keyed within the
    model: another project's request under the same id is not taken for a redelivery."""
    await record_step(
        db,
        request_id="r1",
        project=A,
        model=MODEL,
        step=1,
        group_ids=["g"],
        trained=True,
        metrics={"loss": 1.0},
    )
    assert await completed_step(db, A, MODEL, "r1") == (1, {"loss": 1.0}, ["g"])
    assert await completed_step(db, B, MODEL, "r1") is None
    await record_step(
        db, request_id="r1", project=B, model=MODEL, step=1, group_ids=["h"], trained=True, metrics={}
    )
    assert await completed_step(db, B, MODEL, "r1") == (1, {}, ["h"])


def test_events_a_train_request_causes_have_ids_of_their_tenant():
    """The publisher keys checkpoints on the ``checkpoint.saved`` id: two projects' requests under
    one id must cause two ``checkpoint.saved`` events, not one the publisher would take twice."""
    from artery.schemas import TrainRequested
    from artery.services.trainer.service import request_event_id

    mine = TrainRequested(id="r1", project=A, model=MODEL, group_ids=["g"])
    theirs = msgspec.structs.replace(mine, project=B)
    assert request_event_id("saved", mine) == request_event_id("saved", mine)  # a redelivery
    assert request_event_id("saved", mine) != request_event_id("saved", theirs)
    assert request_event_id("saved", mine) != request_event_id("completed", mine)
