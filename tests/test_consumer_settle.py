"""A consume loop survives what it cannot settle, and a service whose loop ends unasked exits.

The in-memory bus (``artery.testing.memory_bus``) stands in for NATS: these are the failure paths
a real server produces only by chance (a publish timeout while a dead letter is written); the real
path is every integration test.
"""

from __future__ import annotations

import asyncio

import pytest

from artery.shared import service_runner, subjects
from artery.shared.consumer import ConsumerOptions, ConsumingService, DurableConsumer
from artery.shared.errors import InvalidMessage
from artery.shared.settings import CommonSettings
from artery.testing.memory_bus import MemoryJetStream, MemoryMsg


async def test_a_dead_letter_that_cannot_be_published_leaves_the_message_for_redelivery():
    async def handler(msgs):
        return [InvalidMessage("validation", "bad") if m.data.startswith(b'{"bad"') else None for m in msgs]

    js = MemoryJetStream(unreachable=True)
    consumer = DurableConsumer(
        js,
        service="collector",
        stream=subjects.TRAJECTORIES,
        durable="collector",
        filter_subject="artery.traj.>",
        handler=handler,
        options=ConsumerOptions(backoff_initial_s=0.01, backoff_max_s=0.01),
    )
    bad = MemoryMsg("artery.traj.p.m", b'{"bad": true}', stream="ARTERY_TRAJECTORIES", seq=1)
    good = MemoryMsg("artery.traj.p.m", b"{}", stream="ARTERY_TRAJECTORIES", seq=2)
    await consumer.process([bad, good])  # does not raise
    assert js.publish_attempts == 1  # the dead letter was tried
    assert bad.settled == []  # not terminated without its dead letter: redelivered after ack_wait
    assert good.settled == ["ack"]  # the rest of the batch is settled as usual
    assert consumer.stats.dead_lettered == {}


class CrashingService(ConsumingService):
    def __init__(self):
        self.consumers, self.closed, self.stopped = [], False, False

    async def start(self):
        pass

    async def run(self):
        raise ValueError("a bug in the loop")

    def stop(self):
        self.stopped = True

    async def close(self):
        self.closed = True


async def test_a_service_whose_consumers_end_unasked_exits_with_the_error(monkeypatch):
    async def nothing(*args, **kwargs):
        return None

    monkeypatch.setattr(service_runner, "connect_service", nothing)
    monkeypatch.setattr(service_runner, "migrate_when_ready", nothing)
    monkeypatch.setattr(service_runner.bus, "close", nothing)
    service = CrashingService()
    stop = asyncio.Event()  # never set: the process would otherwise wait here for good
    common = CommonSettings(database_url="postgresql://unused")
    with pytest.raises(ValueError, match="a bug in the loop"):
        await asyncio.wait_for(
            service_runner.serve_consumers("collector", common, stop, lambda nc, url: service), timeout=30
        )
    assert service.stopped and service.closed
