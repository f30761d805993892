"""No hand-off waits for its safety-net timeout (#31): the event-driven waits are woken by the
news itself, and every fallback that does fire is counted, so a missed wake-up fails a test."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from nats.aio.msg import Msg

import artery as art
from artery import backend as artery_backend
from artery.schemas import GroupReady, ReplicaInfo, TrainCompleted, TrainRequested, new_event_id
from artery.services.collector.store import StoredGroup, write_groups
from artery.services.trainer import service as trainer_service
from artery.shared import subjects
from artery.shared.bus import publish_event
from artery.shared.codec import encode
from artery.shared.models import TINY
from artery.shared.registry import served_by_updates
from artery.shared.wakeup import fallbacks_fired, woken_by
from artery.testing.agents import half_alphabet_rollout
from tests.factories import register_trainable
from tests.test_trainer_budgets import Answers, request, running_trainer, settings_for
from tests.test_trainer_fairness import text_group


async def test_only_a_timeout_followed_by_a_true_condition_is_a_fallback(nc):
    waiter = "test_counting"
    subject = "artery.test.wakeup"
    async with woken_by(nc, subject, waiter=waiter) as wake:
        wake.clear()
        assert await wake.wait(0.01) is False  # a real timeout: the condition is still false
        wake.clear()
        await nc.publish(subject, b"news")
        assert await wake.wait(30) is True
        wake.satisfied()  # woken by the message: no fallback
        assert fallbacks_fired().get(waiter, 0) == 0
        wake.clear()
        assert await wake.wait(0.01) is False
        wake.satisfied()  # the recheck after the timeout found it true: a missed wake-up
    assert fallbacks_fired()[waiter] == 1


async def test_the_registry_update_that_wakes_the_waiter_tells_what_the_replica_serves(js):
    """The wake-up carries the entry: what the SDK decides on does not depend on the stream
    having stored the put by the time it reads (the cause of the 2 s stalls)."""
    kv = await js.key_value(subjects.REPLICAS_BUCKET)
    project, model = "p.1", "m"
    keys = subjects.kv_updates(subjects.REPLICAS_BUCKET, subjects.replica_keys(project, model))
    info = ReplicaInfo(replica_id="r1", project=project, model=model, engine="e", url="u", served=["m@3"])
    async with woken_by(js._nc, keys, waiter="test_heard") as wake:
        wake.clear()
        await kv.put(subjects.replica_key(project, model, "r1"), encode(info))
        assert await wake.wait(30) is True
        assert served_by_updates(wake.latest.values()) == {"r1": ["m@3"]}
        wake.clear()
        await kv.delete(subjects.replica_key(project, model, "r1"))
        assert await wake.wait(30) is True
        assert served_by_updates(wake.latest.values()) == {}  # a deletion serves nothing


@pytest.mark.timeout(600)
async def test_train_steps_never_wait_for_the_safety_net(tmp_path):
    """A real stack on the tiny model: every ``train()`` waits until the step is served, and not
    one of those waits (nor any other in this process) ended on its timeout."""
    before = fallbacks_fired()
    backend = art.LocalBackend(path=tmp_path / "art")
    model = art.TrainableModel(name="agent.1", project="wake", base_model=TINY)
    try:
        await model.register(backend)
        for step in (1, 2, 3):
            groups = await art.gather_trajectory_groups(
                art.trajectory_group(half_alphabet_rollout(model, max_tokens=4) for _ in range(2))
                for _ in range(2)
            )
            result = await model.train(groups, config=art.TrainConfig(learning_rate=1e-3))
            assert result.step == step
            (replica,) = await backend.replicas(model)
            assert model.get_inference_name(step) in replica.served
    finally:
        await backend.close()
    assert fallbacks_fired() == before, "a hand-off waited for its safety-net timeout"


def test_the_loop_benchmark_misses_its_goal_when_a_fallback_fired():
    from loadtests.loop import GOAL_SYNC_WAITING_SHARE, goals

    modes = {"sync": {"waiting_share": GOAL_SYNC_WAITING_SHARE}}
    assert {g["status"] for g in goals(modes, 0).values()} == {"PASS"}
    missed = goals(modes, 1)
    assert missed["fallbacks_fired"] == {"goal": 0, "reached": 1, "status": "MISSED"}
    assert goals({"sync": {"waiting_share": 0.2}}, 0)["sync_waiting_share"]["status"] == "MISSED"


def _trajectory(reward: float) -> art.Trajectory:
    messages = [{"role": "user", "content": "say a"}, {"role": "assistant", "content": "a"}]
    return art.Trajectory(messages_and_choices=messages, reward=reward)


@pytest.mark.parametrize("served_first", [True, False], ids=["served-before-the-answer", "served-after"])
async def test_train_reads_the_step_once_and_the_replica_list_while_it_trains(
    nats_server, js, monkeypatch, served_first
):
    """Every read on the way of a step is waiting, not work (#31). This test is the trainer and the
    replica: the request names the step ``publish`` read for the groups (no second registry read),
    and the replica list is read while the step trains. A replica that serves the step before
    its answer arrives (it loads the step as saved) wakes nothing: ``train()`` finds it served
    once answered, without asking for the list again. One that serves it after the answer is
    read again once (the membership may have changed while the step trained), and its entry
    wakes ``train()``."""
    project, name = "reads", "agent"
    kv = await js.key_value(subjects.REPLICAS_BUCKET)
    key = subjects.replica_key(project, name, "r1")
    loading = ReplicaInfo(replica_id="r1", project=project, model=name, engine="e", url="u", served=[name])
    await kv.put(key, encode(loading))
    reads_before_serving = 1 if served_first else 2
    read_enough = asyncio.Event()

    async def replica_serves() -> None:
        await read_enough.wait()
        await kv.put(key, encode(msgspec.structs.replace(loading, served=[name, f"{name}@1"])))

    requests: list[TrainRequested] = []
    serving: list[asyncio.Task] = []

    async def trainer(msg) -> None:
        request = msgspec.json.decode(msg.data, type=TrainRequested)
        requests.append(request)
        if served_first:
            await replica_serves()  # before the answer, from the same connection: heard first
        else:
            serving.append(asyncio.create_task(replica_serves()))
        done = TrainCompleted(
            id=new_event_id(), project=project, model=name, step=1, request_id=request.id, metrics={}
        )
        await js._nc.publish(subjects.train("completed", project, name), msgspec.json.encode(done))

    await js._nc.subscribe(subjects.train("requested", project, name), cb=trainer)
    await js._nc.flush()

    backend = art.Backend(nats_url=nats_server.url)
    step_reads, list_reads = [], []
    read_step, read_list = backend._get_step, artery_backend.project_replicas

    async def counted_step(model):
        step_reads.append(model.name)
        return await read_step(model)

    async def counted_list(*args, **kwargs):
        replicas = await read_list(*args, **kwargs)
        list_reads.append([r.served for r in replicas])
        if len(list_reads) == reads_before_serving:
            read_enough.set()
        return replicas

    monkeypatch.setattr(backend, "_get_step", counted_step)
    monkeypatch.setattr(artery_backend, "project_replicas", counted_list)
    model = art.TrainableModel(name=name, project=project, base_model=TINY)
    before = fallbacks_fired()
    try:
        result = await backend.train(model, [art.TrajectoryGroup([_trajectory(0.0), _trajectory(1.0)])])
    finally:
        await backend.close()
    await asyncio.gather(*serving)
    assert result.step == 1
    assert [r.step for r in requests] == [0] and step_reads == [name]
    # Every read found the replica still loading: none was made after it served the step.
    assert list_reads == [[[name]]] * reads_before_serving
    assert fallbacks_fired() == before


def _entry(replica: str, served: list[str], op: str | None = None) -> Msg:
    info = ReplicaInfo(replica_id=replica, project="p", model="m", engine="e", url="u", served=served)
    headers = {"KV-Operation": op} if op else None
    return Msg(
        _client=None, subject=f"$KV.x.p.m.{replica}", data=b"" if op else encode(info), headers=headers
    )


def test_a_step_is_served_by_every_replica_listed_or_heard_of():
    """The entries heard while ``train()`` waits complete the replica list it read: a replica heard
    of that an older list does not name (started since) must serve the step too; after a fresh
    read the list is the membership, so the entry of a replica gone since holds nothing up."""
    from artery.shared.registry import served_by_all
    from artery.shared.wakeup import Wakeup

    listed = [ReplicaInfo(replica_id="r1", project="p", model="m", engine="e", url="u", served=["m"])]
    wake = Wakeup()
    wake.heard(_entry("r1", ["m", "m@1"]))
    assert served_by_all("m@1", listed, wake.latest.values(), joined=True)
    wake.heard(_entry("r2", ["m"]))  # a replica started since the list was read, not serving yet
    assert not served_by_all("m@1", listed, wake.latest.values(), joined=True)
    assert served_by_all(
        "m@1", listed, wake.latest.values(), joined=False
    )  # a fresh list does not name it: gone
    wake.heard(_entry("r2", ["m", "m@1"]))
    assert served_by_all("m@1", listed, wake.latest.values(), joined=True)
    wake.heard(_entry("r1", [], op="DEL"))  # r1 stopped: its listed entry, older, does not serve
    assert not served_by_all("m@1", listed, wake.latest.values(), joined=True)


async def test_a_request_that_comes_before_its_groups_trains_when_they_are_stored(
    nc, js, db, database_url, tmp_path, monkeypatch
):
    """The SDK publishes a request right behind its groups, so the trainer often finds them not
    stored yet. Their ``group.ready`` wakes its check again: the step does not wait for a hand-back
    on a timer (made 120 s here, so that only the wake-up can start the step in time)."""
    monkeypatch.setattr(trainer_service, "recheck_delay", lambda *_: 120.0)
    monkeypatch.setattr(trainer_service, "FIRST_RECHECK_S", 120.0)
    found_missing = asyncio.Event()
    check = trainer_service.Trainer._waits_for_groups

    async def watched(self, msg, request):
        waits = await check(self, msg, request)
        if waits:
            found_missing.set()
        return waits

    monkeypatch.setattr(trainer_service.Trainer, "_waits_for_groups", watched)
    await register_trainable(js, "early", "agent", TINY)
    groups = [text_group("early", "agent", seed) for seed in range(2)]
    async with (
        Answers(js, "early", "agent") as answers,
        running_trainer(nc, database_url, settings_for(tmp_path)),
    ):
        sent = await request(js, "early", "agent", [g.id for g in groups])
        await asyncio.wait_for(found_missing.wait(), 60)
        await write_groups(db, [StoredGroup.of(g, None) for g in groups])
        for group in groups:  # as the collector announces a group once its rows are committed
            ready = GroupReady(
                id=new_event_id(),
                project="early",
                model="agent",
                group_id=group.id,
                num_trajectories=len(group.trajectories),
                rewards=[t.reward for t in group.trajectories],
            )
            await publish_event(js, subjects.group_ready("early", "agent"), ready)
        completed = await answers.of(sent.id, timeout=60)
    assert isinstance(completed, TrainCompleted) and completed.step == 1
