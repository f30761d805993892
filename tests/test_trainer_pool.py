"""A pool of trainer workers (issue 30): two real trainer processes, each with its own checkpoint
directory, share the train requests of 4 models of 2 projects.

Every model's steps are 1..N in its requests' order, none trained twice, none lost, and both
workers train; a worker SIGKILLed inside a step (seen by its inference pause) leaves its model's
lease behind, the other worker takes the model over, resumes it from the newest saved step (the
trainer-state store: the two workers share no disk) and trains the request exactly once, and every
pause it sent is resumed (the dead worker's own pause ends with its short lease).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import msgspec
import pytest

from artery.ops.service_process import ServiceProcess
from artery.schemas import PauseInference, ResumeInference, TrainCompleted
from artery.services.collector.store import StoredGroup, write_groups
from artery.services.trainer.lease import RENEW_EVERY_S, Holder, LeaseLost, Leases
from artery.shared import subjects
from artery.shared.health import NatsReadiness
from artery.shared.models import TINY
from tests.factories import register_trainable
from tests.test_trainer_budgets import Answers, request
from tests.test_trainer_fairness import text_group

MODELS = [("north", "a"), ("north", "b"), ("south", "a"), ("south", "b")]
STEPS = 3
#: How long a dead worker's pause holds the replicas (none here) and its request stays unacknowledged.
PAUSE_LEASE_S = 10.0
ACK_WAIT_S = 4.0


def worker(name: str, nats_url: str, database_url: str, root: Path) -> ServiceProcess:
    env = {
        **os.environ,
        "ARTERY_NATS_URL": nats_url,
        "ARTERY_DATABASE_URL": database_url,
        "ARTERY_LOG_FORMAT": "json",
        "ARTERY_TRAINER_WORKER_ID": name,
        "ARTERY_TRAINER_CHECKPOINT_DIR": str(root / name / "ckpt"),  # no disk shared
        "ARTERY_TRAINER_MICRO_BATCH_SIZE": "1",
        "ARTERY_TRAINER_TORCH_THREADS": "1",
        "ARTERY_TRAINER_ACK_WAIT_S": str(ACK_WAIT_S),
        "ARTERY_TRAINER_PAUSE_LEASE_S": str(PAUSE_LEASE_S),
        "ARTERY_TRAINER_PAUSE_TIMEOUT_S": "1",
    }
    return ServiceProcess(name, env, root / f"{name}.log", service="trainer")


def trained(process: ServiceProcess) -> list[tuple[str, str, int]]:
    """(project, model, step) of each step the worker logged as trained."""
    steps = []
    for line in process.log_path.read_text().splitlines():
        if '"event": "trained"' in line:
            entry = json.loads(line)
            steps.append((entry["project"], entry["model"], entry["step"]))
    return steps


async def train_in_turn(js, answers: Answers, project: str, model: str, group_ids: list[str]) -> list[str]:
    """The SDK's way: each request published once the previous one is answered."""
    ids = []
    for group_id in group_ids:
        sent = await request(js, project, model, [group_id])
        answer = await answers.of(sent.id, timeout=240)
        assert isinstance(answer, TrainCompleted), answer
        ids.append(sent.id)
    return ids


async def test_a_models_lease_is_one_workers_and_a_takeover_is_noticed(nc, js):
    """Held by one worker at a time; a renewal after another worker took the model over raises
    ``LeaseLost``, and the loser's release leaves the new holder's entry alone."""
    kv = await js.key_value(subjects.TRAINER_LEASES_BUCKET)
    key = subjects.model_key("p", "m")
    one, two = Leases(nc, Holder(worker="one")), Leases(nc, Holder(worker="two"))
    held = await one.acquire("p", "m")
    assert held is not None and await two.acquire("p", "m") is None
    await held.confirm()  # renewed: a new revision
    assert (await kv.get(key)).revision == held.revision
    assert await two.acquire("p", "m") is None  # a live holder keeps it (renewed just now)

    await kv.delete(key, last=held.revision)  # as a worker that found the holder dead does
    taken = await two.acquire("p", "m")
    assert taken is not None
    with pytest.raises(LeaseLost):
        await held.confirm()
    assert held.lost
    await held.release()
    assert msgspec.json.decode((await kv.get(key)).value, type=Holder).worker == "two"
    await taken.release()
    again = await one.acquire("p", "m")
    assert again is not None
    await again.release()


async def test_a_worker_restarted_under_its_id_takes_its_former_lease_over(nc, js):
    """An entry naming this worker that this process does not hold is a former life's (a crash):
    taken over at once; another worker's entry is left to its holder's renewals."""
    kv = await js.key_value(subjects.TRAINER_LEASES_BUCKET)
    await kv.create(subjects.model_key("p", "old"), msgspec.json.encode(Holder(worker="one")))
    await kv.create(subjects.model_key("p", "other"), msgspec.json.encode(Holder(worker="two")))
    one = Leases(nc, Holder(worker="one"))
    resumed = await one.acquire("p", "old")
    assert resumed is not None
    assert await one.acquire("p", "other") is None
    await resumed.release()


async def test_a_dead_holder_is_told_from_a_live_worker_with_the_same_pid_and_address(nc, js):
    """In Kubernetes every trainer may be pid 1 at ``0.0.0.0:9464``: the ping's instance id, not
    the pid and address, tells whether the holder still runs. While its instance answers the
    model stays held; once it is gone the asking worker, with the same pid and address, takes
    the model over instead of waiting out the TTL."""
    kv = await js.key_value(subjects.TRAINER_LEASES_BUCKET)
    key = subjects.model_key("p", "m")
    same = {"pid": "1", "metrics_url": "http://0.0.0.0:9464"}
    holder = Holder(worker="holder", instance="holder-life", **same)
    asker = Holder(worker="asker", instance="asker-life", **same)
    entry_revision = await kv.create(key, msgspec.json.encode(holder))
    service = subjects.HEALTH_SERVICE.format(service="trainer")
    pings = {
        h.instance: NatsReadiness(nc, service, {"service": "trainer", "instance": h.instance, **same})
        for h in (holder, asker)
    }
    for readiness in pings.values():
        await readiness.start()
    try:
        leases = Leases(nc, asker)
        # The revision has outlived a renewal and a half: the holder gets judged by its ping.
        leases._seen = {(key, entry_revision): time.monotonic() - 2 * RENEW_EVERY_S}
        assert await leases.acquire("p", "m") is None  # its instance answers: alive
        await pings.pop(holder.instance).stop()
        taken = await leases.acquire("p", "m")
        assert taken is not None
        assert msgspec.json.decode((await kv.get(key)).value, type=Holder) == asker
        await taken.release()
    finally:
        for readiness in pings.values():
            await readiness.stop()


@pytest.mark.timeout(900)
@pytest.mark.slow
async def test_two_workers_train_four_models_in_order_and_survive_a_sigkill(
    nats_server, nc, js, db, database_url, tmp_path
):
    for project, model in MODELS:
        await register_trainable(js, project, model, TINY)
    workers = [worker(name, nats_server.url, database_url, tmp_path) for name in ("w1", "w2")]
    controls: list[tuple[str, PauseInference | ResumeInference]] = []

    async def control(msg):
        kind = msg.subject.rsplit(".", 1)[-1]
        event = msgspec.json.decode(msg.data, type=PauseInference if kind == "pause" else ResumeInference)
        controls.append((kind, event))

    sub = await nc.subscribe(f"{subjects.PREFIX}.control.inference.>", cb=control)
    answers = {key: Answers(js, *key) for key in MODELS}
    for a in answers.values():
        await a.__aenter__()
    try:
        for process in workers:
            process.start()
        for process in workers:
            await asyncio.to_thread(process.wait_ready, 180)

        # 4 models at once, each one request after another: steps 1..N each, on both workers.
        groups = {key: [text_group(*key, seed) for seed in range(STEPS)] for key in MODELS}
        await write_groups(db, [StoredGroup.of(g, None) for some in groups.values() for g in some])
        sent = await asyncio.gather(
            *(train_in_turn(js, answers[key], *key, [g.id for g in groups[key]]) for key in MODELS)
        )
        for key, ids in zip(MODELS, sent, strict=True):
            assert [answers[key].by_request[i].step for i in ids] == list(range(1, STEPS + 1)), key
        by_worker = {process.name: trained(process) for process in workers}
        every = [step for steps in by_worker.values() for step in steps]
        assert sorted(every) == sorted((*key, s) for key in MODELS for s in range(1, STEPS + 1)), by_worker
        assert all(by_worker.values()), f"one worker trained nothing: {by_worker}"

        # A long step of north/a; the worker inside it (its pause says which) is SIGKILLed.
        project, model = MODELS[0]
        long = text_group(project, model, 100, size=16)
        for trajectory in long.trajectories:  # ~1,800 tokens each, one per micro-batch
            trajectory.messages[-1].content = "abc def " * 220
        await write_groups(db, [StoredGroup.of(long, None)])
        pauses_before = len(controls)
        killed_request = await request(js, project, model, [long.id])

        def pauser() -> str | None:
            for kind, event in controls[pauses_before:]:
                if kind == "pause" and msg_model(event) == (project, model):
                    return event.requested_by
            return None

        loop = asyncio.get_running_loop()
        deadline = loop.time() + 120
        while (victim_name := pauser()) is None:
            assert loop.time() < deadline, "no worker paused inference for the long step"
            await asyncio.sleep(0.05)
        victim = next(p for p in workers if p.name == victim_name)
        survivor = next(p for p in workers if p.name != victim_name)
        victim.signal(signal.SIGKILL)
        await asyncio.to_thread(victim.popen().wait, 30)
        assert not any(step[:2] == (project, model) and step[2] > STEPS for step in trained(victim))

        # The survivor takes the model over once the lease is free, resumes it from step STEPS
        # (saved by whichever worker trained it: from the trainer-state store when not its own)
        # and trains the request once.
        done = await answers[(project, model)].of(killed_request.id, timeout=300)
        assert isinstance(done, TrainCompleted) and done.step == STEPS + 1, done
        assert (project, model, STEPS + 1) in trained(survivor)
        if (project, model, STEPS) not in trained(survivor):  # the dead worker saved step STEPS
            restored = [
                json.loads(line)
                for line in survivor.log_path.read_text().splitlines()
                if '"event": "step taken from the trainer-state store"' in line
            ]
            assert any((r["project"], r["model"], r["step"]) == (project, model, STEPS) for r in restored)
        assert answers[(project, model)].order.count(killed_request.id) == 1
        rows = await db.fetch(
            "SELECT step, request_id FROM training_steps WHERE project = $1 AND model = $2 ORDER BY step",
            project,
            model,
        )
        assert [r["step"] for r in rows] == list(range(1, STEPS + 2))
        assert rows[-1]["request_id"] == killed_request.id

        # Nothing stays paused: every pause the live workers sent was resumed; the dead one's
        # (never resumed) ends with its lease.
        resumed = {event.lease_id for kind, event in controls if kind == "resume"}
        for kind, event in controls:
            if kind == "pause" and event.lease_id not in resumed:
                assert event.requested_by == victim.name and event.lease_seconds == PAUSE_LEASE_S, event
    finally:
        await sub.unsubscribe()
        for a in answers.values():
            await a.__aexit__(None, None, None)
        for process in workers:
            process.stop()


def msg_model(event: PauseInference | ResumeInference) -> tuple[str, str]:
    return event.project, event.model
