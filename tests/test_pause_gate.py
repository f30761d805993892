"""The pause gate alone (no NATS): waiting, draining, leases that end by themselves."""

from __future__ import annotations

import asyncio

import pytest

from artery.services.inference.pause import EnginePaused, PauseGate


async def request(gate: PauseGate, done: list[int], i: int, work_s: float = 0.01, **kw) -> None:
    async with gate.admit(**kw):
        await asyncio.sleep(work_s)
        done.append(i)


async def test_requests_during_pause_wait_and_all_complete_after_resume():
    gate = PauseGate(max_wait_s=5)
    await gate.pause("L1", 10, drain_timeout_s=1)
    done: list[int] = []
    tasks = [asyncio.create_task(request(gate, done, i)) for i in range(20)]
    await asyncio.sleep(0.1)
    assert done == [] and gate.waiting == 20 and gate.in_flight == 0
    assert await gate.resume("L1") is True
    await asyncio.gather(*tasks)
    assert sorted(done) == list(range(20))
    assert not gate.paused and gate.waiting == 0 and gate.in_flight == 0


async def test_waiting_longer_than_the_limit_raises_engine_paused():
    gate = PauseGate(max_wait_s=0.1)
    await gate.pause("L1", 10, drain_timeout_s=1)
    with pytest.raises(EnginePaused) as paused:
        await request(gate, [], 0)
    assert paused.value.retry_after is not None and 9 < paused.value.retry_after <= 10
    assert gate.waiting == 0 and gate.in_flight == 0
    await gate.close()


async def test_lease_expiry_resumes_without_anyone_calling_resume():
    calls: list[str] = []

    async def sleep() -> bool:
        calls.append("sleep")
        return True

    async def wake() -> None:
        calls.append("wake")

    gate = PauseGate(on_pause=sleep, on_resume=wake)
    result = await gate.pause("L1", 0.2, drain_timeout_s=1)
    assert result.paused and result.freed_memory and not result.renewed
    done: list[int] = []
    waiting = asyncio.create_task(request(gate, done, 1))
    await asyncio.sleep(0.4)
    assert not gate.paused
    await asyncio.wait_for(waiting, 1)
    assert done == [1]
    assert calls == ["sleep", "wake"]  # woken before the waiting request was admitted


async def test_renewal_extends_the_lease():
    gate = PauseGate()
    await gate.pause("L1", 0.3, drain_timeout_s=1)
    for _ in range(4):  # 0.6 s in all, twice the lease, kept alive by renewals
        await asyncio.sleep(0.15)
        result = await gate.pause("L1", 0.3, drain_timeout_s=1)
        assert result.renewed and gate.paused
    await asyncio.sleep(0.45)
    assert not gate.paused


async def test_every_lease_must_end_before_resuming():
    gate = PauseGate()
    await gate.pause("A", 10, drain_timeout_s=1)
    await gate.pause("B", 0.2, drain_timeout_s=1)
    assert sorted(gate.lease_ids) == ["A", "B"]
    assert await gate.resume("A") is False  # B still holds it
    assert await gate.resume("unknown") is False
    await asyncio.sleep(0.35)  # B expires on its own
    assert not gate.paused
    assert await gate.resume("A") is True  # idempotent: admitting


async def test_pause_drains_in_flight_requests_before_sleeping():
    slept_with_in_flight: list[int] = []
    gate = PauseGate()

    async def sleep() -> bool:
        slept_with_in_flight.append(gate.in_flight)
        return True

    gate.on_pause = sleep
    done: list[int] = []
    running = [asyncio.create_task(request(gate, done, i, work_s=0.2)) for i in range(3)]
    await asyncio.sleep(0.05)
    assert gate.in_flight == 3
    result = await gate.pause("L1", 10, drain_timeout_s=2)
    assert result.drained == 3 and result.still_running == 0 and result.freed_memory
    assert sorted(done) == [0, 1, 2] and slept_with_in_flight == [0]
    await asyncio.gather(*running)
    await gate.close()


async def test_drain_timeout_reports_what_is_still_running_and_does_not_sleep():
    slept: list[bool] = []

    async def sleep() -> bool:
        slept.append(True)
        return True

    gate = PauseGate(on_pause=sleep)
    done: list[int] = []
    long = asyncio.create_task(request(gate, done, 0, work_s=0.5))
    await asyncio.sleep(0.02)
    result = await gate.pause("L1", 10, drain_timeout_s=0.1)
    assert result.paused and result.still_running == 1 and result.drained == 0
    assert not result.freed_memory and slept == []
    await long
    renewed = await gate.pause("L1", 10, drain_timeout_s=0.1)  # drained now: sleeps on renewal
    assert renewed.still_running == 0 and renewed.freed_memory and slept == [True]
    await gate.close()


async def test_resume_during_drain_leaves_the_gate_open():
    gate = PauseGate()
    done: list[int] = []
    long = asyncio.create_task(request(gate, done, 0, work_s=0.3))
    await asyncio.sleep(0.02)
    pausing = asyncio.create_task(gate.pause("L1", 10, drain_timeout_s=1))
    await asyncio.sleep(0.05)
    assert await gate.resume("L1") is True
    result = await pausing
    assert not result.paused and not gate.paused
    await long


async def test_failing_wake_hook_still_admits():
    async def broken_wake() -> None:
        raise RuntimeError("engine gone")

    async def sleep() -> bool:
        return True

    gate = PauseGate(on_pause=sleep, on_resume=broken_wake)
    await gate.pause("L1", 0.1, drain_timeout_s=1)
    await asyncio.sleep(0.25)
    assert not gate.paused
    await request(gate, [], 0, max_wait_s=0.01)
