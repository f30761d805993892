"""Pause/resume over a real nats-server: two replicas in-process, the trainer's client against them."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import msgspec
import pytest

from artery.schemas import DeadLetter, PauseAck, PauseInference
from artery.schemas.base import new_event_id
from artery.services.inference.control import ControlServer, ReplicaRegistry
from artery.services.inference.pause import PauseGate
from artery.shared import bus, subjects
from artery.shared.codec import encode
from artery.shared.control_client import (
    PauseFailed,
    live_replicas,
    pause_replicas,
    paused,
    renew,
    resume_replicas,
)
from artery.shared.settings import CommonSettings
from tests.helpers import FakeEngine, wait_until

PROJECT, MODEL = "proj", "agent"


@pytest.fixture
def common_settings(nats_server) -> CommonSettings:
    # These tests need NATS only; overriding this keeps PostgreSQL out of them.
    return CommonSettings(nats_url=nats_server.url)


@dataclass
class Replica:
    replica_id: str
    gate: PauseGate
    engine: FakeEngine
    control: ControlServer
    registry: ReplicaRegistry


@pytest.fixture
async def start_replica(common_settings):
    started: list[tuple[Replica, object]] = []

    async def start(replica_id: str, **gate_options) -> Replica:
        conn = await bus.connect(common_settings, name=replica_id)
        engine = FakeEngine()
        gate = PauseGate(on_pause=engine.sleep, on_resume=engine.wake, **gate_options)
        registry = ReplicaRegistry(
            conn.jetstream(),
            gate,
            replica_id=replica_id,
            project=PROJECT,
            model=MODEL,
            engine=engine.kind,
            url=f"http://{replica_id}:8000",
            served=lambda: [MODEL],
            heartbeat_s=0.5,
        )
        control = ControlServer(
            conn, gate, replica_id=replica_id, project=PROJECT, model=MODEL, on_change=registry.beat
        )
        await control.start()
        await registry.start()
        replica = Replica(replica_id, gate, engine, control, registry)
        started.append((replica, conn))
        return replica

    yield start
    for replica, conn in started:
        await replica.control.stop()
        await replica.registry.stop()
        await replica.gate.close()
        await conn.close()


async def test_replicas_register_and_deregister(nc, js, start_replica):
    a = await start_replica("replica-a")
    await start_replica("replica-b")
    live = await live_replicas(js, PROJECT, MODEL)
    assert sorted(r.replica_id for r in live) == ["replica-a", "replica-b"]
    assert all(r.served == [MODEL] and r.heartbeat_at is not None for r in live)
    assert await live_replicas(js, PROJECT, "other") == []
    await a.registry.stop()
    assert [r.replica_id for r in await live_replicas(js, PROJECT, MODEL)] == ["replica-b"]


async def test_pause_reaches_every_replica_and_waiting_requests_complete_after_resume(nc, start_replica):
    a = await start_replica("replica-a")
    b = await start_replica("replica-b")
    outcome = await pause_replicas(nc, PROJECT, MODEL, lease_seconds=30, requested_by="trainer", timeout_s=5)
    assert outcome.ok and sorted(outcome.acked) == ["replica-a", "replica-b"] and outcome.missing == []
    assert all(ack.paused and ack.freed_memory for ack in outcome.acked.values())
    assert a.gate.paused and b.gate.paused
    assert a.engine.calls == b.engine.calls == ["sleep"]
    # The heartbeat (written right after the ack) shows the pause and its lease.
    await wait_until(lambda: a.registry.info().paused)

    done: list[str] = []

    async def request(replica: Replica, i: int) -> None:
        async with replica.gate.admit():
            done.append(f"{replica.replica_id}:{i}")

    tasks = [asyncio.create_task(request(r, i)) for r in (a, b) for i in range(10)]
    await asyncio.sleep(0.2)
    assert done == []
    resumed = await resume_replicas(nc, PROJECT, MODEL, outcome.lease_id, requested_by="trainer", timeout_s=5)
    assert sorted(resumed.acked) == ["replica-a", "replica-b"] and resumed.still_paused == []
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert len(done) == 20
    assert a.engine.calls == b.engine.calls == ["sleep", "wake"]


async def test_a_lease_that_is_not_renewed_resumes_every_replica_on_its_own(nc, start_replica):
    a = await start_replica("replica-a")
    b = await start_replica("replica-b")
    await pause_replicas(nc, PROJECT, MODEL, lease_seconds=0.5, requested_by="trainer", timeout_s=5)
    assert a.gate.paused and b.gate.paused
    await wait_until(lambda: not a.gate.paused and not b.gate.paused, timeout=3)
    assert a.engine.calls == b.engine.calls == ["sleep", "wake"]


async def test_renew_keeps_the_pause(nc, start_replica):
    a = await start_replica("replica-a")
    outcome = await pause_replicas(nc, PROJECT, MODEL, lease_seconds=0.6, requested_by="t", timeout_s=5)
    for _ in range(3):
        await asyncio.sleep(0.3)
        again = await renew(nc, PROJECT, MODEL, outcome.lease_id, lease_seconds=0.6, requested_by="t")
        assert again.ok and a.gate.paused
    assert a.engine.calls == ["sleep"]


async def test_a_replica_that_does_not_answer_fails_the_pause_by_name(nc, start_replica):
    a = await start_replica("replica-a")
    b = await start_replica("replica-b")
    await b.control.stop()  # still registered in KV, no longer listening
    with pytest.raises(PauseFailed, match="replica-b") as failure:
        await pause_replicas(nc, PROJECT, MODEL, lease_seconds=30, requested_by="trainer", timeout_s=0.5)
    outcome = failure.value.outcome
    assert outcome.missing == ["replica-b"] and list(outcome.acked) == ["replica-a"]
    # The replica that did pause was released at once, not left to sit out the lease.
    await wait_until(lambda: not a.gate.paused)


async def test_paused_context_renews_and_resumes_on_exception(nc, start_replica):
    a = await start_replica("replica-a")
    b = await start_replica("replica-b")
    with pytest.raises(RuntimeError, match="training blew up"):
        async with paused(nc, PROJECT, MODEL, 0.6, requested_by="trainer", timeout_s=5) as lease:
            assert a.gate.paused and b.gate.paused
            await asyncio.sleep(1.0)  # longer than the lease: only renewals keep it paused
            assert a.gate.paused and b.gate.paused
            assert lease.renewals >= 2 and lease.renew_failures == []
            raise RuntimeError("training blew up")
    assert not a.gate.paused and not b.gate.paused
    assert a.engine.calls == ["sleep", "wake"]


async def test_no_live_replica_means_nothing_to_pause(nc):
    outcome = await pause_replicas(nc, PROJECT, MODEL, lease_seconds=5, requested_by="t", timeout_s=5)
    assert outcome.ok and outcome.nothing_to_pause and outcome.elapsed_s < 1
    async with paused(nc, PROJECT, MODEL, 5, requested_by="t") as lease:
        assert lease.outcome.nothing_to_pause


async def test_bad_control_input_is_answered_with_an_error_and_dead_lettered(nc, js, start_replica):
    a = await start_replica("replica-a")
    b = await start_replica("replica-b")
    subject = subjects.control("pause", PROJECT, MODEL)
    reply = await nc.request(subject, b'{"event": "control.pause", "lease_id": "L-bad"}', timeout=5)
    ack = msgspec.json.decode(reply.data, type=PauseAck)
    assert ack.replica_id in ("replica-a", "replica-b") and ack.lease_id == "L-bad" and not ack.paused
    assert ack.error and "validation" in ack.error
    # Meant for another model: refused too.
    wrong = PauseInference(
        id=new_event_id(), project=PROJECT, model="other", lease_id="L2", lease_seconds=5, requested_by="t"
    )
    reply = await nc.request(subject, encode(wrong), timeout=5)
    assert "wrong_target" in msgspec.json.decode(reply.data, type=PauseAck).error
    assert not a.gate.paused and not b.gate.paused
    await asyncio.sleep(0.2)  # the other replica's reply and dead letter

    sub = await js.subscribe(subjects.dead_letter("inference"), ordered_consumer=True)
    letters = []
    with contextlib.suppress(Exception):
        while True:
            letters.append(msgspec.json.decode((await sub.next_msg(timeout=1)).data, type=DeadLetter))
    # Both replicas rejected both requests; the derived ids left one dead letter per request.
    assert sorted(letter.kind for letter in letters) == ["validation", "wrong_target"]
    await sub.unsubscribe()
