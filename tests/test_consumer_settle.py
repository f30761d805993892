"""A consume loop survives what it cannot settle, and a service whose loop ends unasked exits.

In-memory doubles for NATS: these are the failure paths a real server produces only by chance
(a publish timeout while a dead letter is written); the real path is every integration test.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from artery.shared import service_runner, subjects
from artery.shared.consumer import ConsumerOptions, ConsumingService, DurableConsumer
from artery.shared.errors import InvalidMessage
from artery.shared.settings import CommonSettings


class UnreachableJetStream:
    """Every publish times out, as during a reconnect."""

    published = 0

    async def publish(self, *args, **kwargs):
        self.published += 1
        raise TimeoutError("nats: timeout")


class Message:
    def __init__(self, subject: str, seq: int):
        self.subject, self.data, self.headers = subject, b'{"bad": true}', {}
        self.metadata = SimpleNamespace(
            num_pending=0,
            num_delivered=1,
            stream="ARTERY_TRAJECTORIES",
            sequence=SimpleNamespace(stream=seq),
        )
        self.settled: list[str] = []

    async def ack(self):
        self.settled.append("ack")

    async def nak(self, delay=None):
        self.settled.append("nak")

    async def term(self):
        self.settled.append("term")


async def test_a_dead_letter_that_cannot_be_published_leaves_the_message_for_redelivery():
    async def handler(msgs):
        return [InvalidMessage("validation", "bad") if m.data.startswith(b'{"bad"') else None for m in msgs]

    js = UnreachableJetStream()
    consumer = DurableConsumer(
        js,
        service="collector",
        stream=subjects.TRAJECTORIES,
        durable="collector",
        filter_subject="artery.traj.>",
        handler=handler,
        options=ConsumerOptions(backoff_initial_s=0.01, backoff_max_s=0.01),
    )
    bad, good = Message("artery.traj.p.m", 1), Message("artery.traj.p.m", 2)
    good.data = b"{}"
    await consumer.process([bad, good])  # does not raise
    assert js.published == 1  # the dead letter was tried
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
