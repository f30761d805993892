"""One tenant cannot stall the trainer for the others (issue 27, finding 4, and the stop of finding 2).

Against a real nats-server and PostgreSQL, with the tiny model: a request naming groups that are
not stored is handed back to wait while another project's request trains; the next request is
picked round-robin over projects; a trainer asked to stop in the middle of a long step stops
within its grace and leaves the request to be delivered again.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

from artery.ops.service_process import ServiceProcess
from artery.schemas import (
    Message,
    TrainCompleted,
    TrainFailed,
    TrainRequested,
    Trajectory,
    TrajectoryGroupSubmitted,
    new_event_id,
)
from artery.services.collector.store import StoredGroup, write_groups
from artery.shared import subjects
from artery.shared.bus import publish_event
from artery.shared.models import TINY
from artery.shared.runtime import SHUTDOWN_GRACE_S
from tests.factories import register_trainable
from tests.test_trainer_budgets import Answers, request, running_trainer, settings_for


def text_group(project: str, model: str, seed: int, size: int = 4) -> TrajectoryGroupSubmitted:
    """Plain-text rollouts (the chat template path) with different rewards."""
    return TrajectoryGroupSubmitted(
        id=new_event_id(),
        project=project,
        model=model,
        trajectories=[
            Trajectory(
                messages=[
                    Message(role="user", content=f"Say something {seed}."),
                    Message(role="assistant", content="abc def " * (i + 1), trainable=True),
                ],
                reward=i / size,
            )
            for i in range(size)
        ],
    )


async def test_a_request_waiting_for_its_groups_does_not_hold_another_projects_request(
    nc, js, db, database_url, tmp_path
):
    """Project ``hostile`` names a group that is never stored; project ``other``'s request,
    published after it, trains while the hostile one waits (it held the trainer for the whole
    ``group_wait_s`` before), and the hostile one is answered when its wait runs out."""
    await register_trainable(js, "hostile", "agent", TINY)
    await register_trainable(js, "other", "agent", TINY)
    groups = [text_group("other", "agent", seed) for seed in range(2)]
    await write_groups(db, [StoredGroup.of(g, None) for g in groups])
    settings = settings_for(tmp_path, group_wait_s=20.0)
    async with (
        Answers(js, "hostile", "agent") as hostile_answers,
        Answers(js, "other", "agent") as other_answers,
        running_trainer(nc, database_url, settings) as trainer,
    ):
        waiting = await request(js, "hostile", "agent", ["never-stored"])
        started = time.monotonic()
        trained = await request(js, "other", "agent", [g.id for g in groups])
        completed = await other_answers.of(trained.id, timeout=60)
        assert isinstance(completed, TrainCompleted) and completed.step == 1
        assert waiting.id not in hostile_answers.by_request, "the waiting request was answered first"
        failed = await hostile_answers.of(waiting.id, timeout=60)
        assert isinstance(failed, TrainFailed) and failed.retriable and "never stored" in failed.error
        assert time.monotonic() - started >= settings.group_wait_s - 1  # it did wait its turn out
        assert trainer.consumer.stats.dead_lettered == {}


async def test_groups_stored_while_the_request_waits_are_trained(nc, js, db, database_url, tmp_path):
    """The request published before its groups are stored (as the SDK may race the collector)
    trains once they are: handing it back loses nothing."""
    await register_trainable(js, "late", "agent", TINY)
    groups = [text_group("late", "agent", seed) for seed in range(2)]
    async with (
        Answers(js, "late", "agent") as answers,
        running_trainer(nc, database_url, settings_for(tmp_path)) as trainer,
    ):
        early = await request(js, "late", "agent", [g.id for g in groups])

        async def handed_back():
            info = await js.consumer_info(subjects.TRAINING.name, "trainer")
            return info.num_redelivered > 0 or info.delivered.consumer_seq > 1

        deadline = asyncio.get_running_loop().time() + 30
        while not await handed_back():
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.05)
        await write_groups(db, [StoredGroup.of(g, None) for g in groups])
        completed = await answers.of(early.id)
        assert isinstance(completed, TrainCompleted) and completed.step == 1
        assert trainer.consumer.stats.dead_lettered == {} and trainer.consumer.stats.retried == 0


async def test_the_next_request_is_picked_round_robin_over_projects(nc, js, db, database_url, tmp_path):
    """Project ``busy`` queues three requests, then project ``quiet`` one: ``quiet``'s trains
    second, not fourth."""
    await register_trainable(js, "busy", "agent", TINY)
    await register_trainable(js, "quiet", "agent", TINY)
    busy_groups = [text_group("busy", "agent", seed) for seed in range(3)]
    quiet_group = text_group("quiet", "agent", 9)
    await write_groups(db, [StoredGroup.of(g, None) for g in [*busy_groups, quiet_group]])
    async with Answers(js, "busy", "agent") as busy, Answers(js, "quiet", "agent") as quiet:
        busy_requests = [await request(js, "busy", "agent", [g.id]) for g in busy_groups]
        quiet_request = await request(js, "quiet", "agent", [quiet_group.id])
        async with running_trainer(nc, database_url, settings_for(tmp_path)):
            for event in busy_requests:
                assert isinstance(await busy.of(event.id), TrainCompleted)
            assert isinstance(await quiet.of(quiet_request.id), TrainCompleted)
        finished = {rid: event.time for rid, event in {**busy.by_request, **quiet.by_request}.items()}
    order = sorted(finished, key=finished.get)
    assert order.index(quiet_request.id) == 1, [
        "quiet" if rid == quiet_request.id else "busy" for rid in order
    ]


async def test_a_trainer_asked_to_stop_mid_step_stops_within_its_grace(
    nats_server, js, db, database_url, tmp_path
):
    """SIGTERM while a long step runs (48 sequences of ~1,800 tokens, one per micro-batch: about a
    minute on one core): the step ends between micro-batches and the process exits well within
    its grace (it was SIGKILLed after finishing the step before); the request is not answered and
    stays unacknowledged, for the next trainer."""
    await register_trainable(js, "long", "agent", TINY)
    group = text_group("long", "agent", 0, size=48)
    for trajectory in group.trajectories:  # every answer as long: ~1,800 tokens each
        trajectory.messages[-1].content = "abc def " * 220
    await write_groups(db, [StoredGroup.of(group, None)])
    log_path = tmp_path / "trainer.log"
    env = {
        **os.environ,
        "ARTERY_NATS_URL": nats_server.url,
        "ARTERY_DATABASE_URL": database_url,
        "ARTERY_LOG_FORMAT": "json",
        "ARTERY_TRAINER_CHECKPOINT_DIR": str(tmp_path / "ckpt"),
        "ARTERY_TRAINER_MICRO_BATCH_SIZE": "1",
        "ARTERY_TRAINER_TORCH_THREADS": "1",
    }
    process = ServiceProcess("trainer", env, log_path)
    process.start()
    try:
        await asyncio.to_thread(process.wait_ready, 120)
        async with Answers(js, "long", "agent") as answers:
            event = TrainRequested(id=new_event_id(), project="long", model="agent", group_ids=[group.id])
            ack = await publish_event(js, subjects.train("requested", "long", "agent"), event)

            def step_started() -> bool:  # its model loaded, and inference (none here) paused
                return b'"event": "no live inference replica; nothing to pause"' in log_path.read_bytes()

            deadline = time.monotonic() + 120
            while not step_started():
                assert time.monotonic() < deadline and process.running, log_path.read_text()[-2000:]
                await asyncio.sleep(0.05)
            stopping = time.monotonic()
            process.signal(signal.SIGTERM)
            code = await asyncio.to_thread(process.proc.wait, SHUTDOWN_GRACE_S + 30)
            took = time.monotonic() - stopping
            assert took < SHUTDOWN_GRACE_S, (
                f"stopped {took:.1f}s after SIGTERM: {log_path.read_text()[-2000:]}"
            )
            assert code == 0, log_path.read_text()[-2000:]
            assert answers.by_request == {}
        info = await js.consumer_info(subjects.TRAINING.name, "trainer")
        assert info.ack_floor.stream_seq < ack.seq  # handed back, not acknowledged
    finally:
        process.stop()


def test_handed_back_requests_of_one_project_are_spread_out():
    """A project's flood cannot fill every window: its ready requests beyond the first two, and
    its waiting ones, come back further and further apart; a wait never runs past its end."""
    from artery.services.trainer.schedule import GROUP_RECHECK_S, Later, RoundRobin, recheck_delay

    assert [Later(rank).delay_s for rank in range(5)] == [0.0, 0.0, 1.0, 2.0, 3.0]
    assert recheck_delay(0.0, 120.0) == 0.1  # just published: its groups may land any moment
    assert recheck_delay(100.0, 120.0) == GROUP_RECHECK_S
    assert recheck_delay(100.0, 120.0, rank=9) == 10 * GROUP_RECHECK_S
    assert recheck_delay(100.0, 120.0, rank=50) == 20.0  # answered when its wait runs out
    order = RoundRobin()
    assert order.pick(["a", "a", "b"]) == 0
    order.served("a")
    assert order.pick(["a", "a", "b"]) == 2
    order.served("b")
    assert order.pick(["b", "a"]) == 1
