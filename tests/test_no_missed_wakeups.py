"""No hand-off waits for its safety-net timeout (#31): the event-driven waits are woken by the
news itself, and every fallback that does fire is counted, so a missed wake-up fails a test."""

from __future__ import annotations

import pytest

import artery as art
from artery.schemas import ReplicaInfo
from artery.shared import subjects
from artery.shared.codec import encode
from artery.shared.models import TINY
from artery.shared.registry import served_by_updates
from artery.shared.wakeup import fallbacks_fired, woken_by
from artery.testing.agents import half_alphabet_rollout


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
