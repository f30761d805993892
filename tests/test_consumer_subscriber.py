"""The typed subscriber (``shared.subscriber``) on a real nats-server: what a handler never has
to do itself. A payload that is not an event, or names another model than its subject, is a dead
letter with its kind; the handler's span continues the publisher's trace; what the handler raises
becomes ack, nak (redelivered, ``ctx.deliveries`` counting) or a dead letter, per ``errors``."""

from __future__ import annotations

import asyncio
import contextlib

import msgspec
import pytest
from opentelemetry import trace

from artery.schemas import CheckpointSaved, DeadLetter
from artery.shared import subjects
from artery.shared.bus import publish_event
from artery.shared.consumer import ConsumerOptions, DurableConsumer
from artery.shared.errors import DependencyUnavailable, InvalidMessage
from artery.shared.subscriber import Delivery, Subscriber
from artery.shared.tracing import setup_sdk_tracing
from tests.helpers import saved, wait_until

pytestmark = pytest.mark.timeout(60)

SERVICE = "subscriber-test"
SUBJECT = subjects.checkpoint("saved", "proj", "agent")


class Recorder:
    """A handler whose behaviour the event's ``uri`` chooses; it records every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[CheckpointSaved, Delivery, trace.SpanContext]] = []
        self.changed = asyncio.Event()

    async def handle(self, event: CheckpointSaved, ctx: Delivery) -> None:
        self.calls.append((event, ctx, trace.get_current_span().get_span_context()))
        self.changed.set()
        if event.uri == "file:///conflict":
            raise InvalidMessage("step_conflict", "another adapter is stored at this step")
        if event.uri == "file:///bug":
            raise RuntimeError("a bug")
        if event.uri == "file:///outage" and ctx.deliveries == 1:
            raise DependencyUnavailable("the database is away")

    def deliveries(self, event: CheckpointSaved) -> list[int]:
        return [ctx.deliveries for seen, ctx, _ in self.calls if seen.id == event.id]


@pytest.fixture
async def running(js, nc):
    """A durable consumer fed by a subscriber, and the dead letters it publishes, as they come."""
    recorder = Recorder()
    subscriber: Subscriber[CheckpointSaved] = Subscriber(
        CheckpointSaved,
        service=SERVICE,
        span="test.handle",
        subject=lambda e: subjects.checkpoint("saved", e.project, e.model),
        attributes=lambda e: {"artery.step": e.step},
    )
    consumer = DurableConsumer(
        js,
        service=SERVICE,
        stream=subjects.CHECKPOINTS,
        durable="subscriber-test",
        filter_subject=subjects.CHECKPOINTS_SAVED,
        handler=subscriber.one_at_a_time(recorder.handle),
        options=ConsumerOptions(
            fetch_timeout_s=0.2, max_deliveries=2, backoff_initial_s=0.05, backoff_max_s=0.05
        ),
    )
    letters: asyncio.Queue[DeadLetter] = asyncio.Queue()

    async def on_letter(msg) -> None:
        await letters.put(msgspec.json.decode(msg.data, type=DeadLetter))

    sub = await nc.subscribe(subjects.dead_letter(SERVICE), cb=on_letter)
    task = asyncio.create_task(consumer.run())
    yield recorder, letters, consumer
    consumer.stop()
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.wait_for(task, 10)
    await sub.unsubscribe()


async def test_a_payload_that_is_not_an_event_is_a_decode_dead_letter(js, running):
    recorder, letters, _ = running
    await js.publish(SUBJECT, b'{"event": "checkpoint.saved", "id": "x"', headers={"Nats-Msg-Id": "m1"})
    letter = await asyncio.wait_for(letters.get(), 10)
    assert (letter.kind, letter.service, letter.subject) == ("decode", SERVICE, SUBJECT)
    assert recorder.calls == []  # the handler never saw it


async def test_a_payload_naming_another_model_than_its_subject_is_a_dead_letter(js, running):
    recorder, letters, _ = running
    other = saved(model="someone-else")
    await publish_event(js, SUBJECT, other)
    letter = await asyncio.wait_for(letters.get(), 10)
    assert letter.kind == "subject_mismatch"
    assert letter.reason == f"proj/someone-else published on {SUBJECT}"
    assert letter.original_id == other.id
    assert recorder.calls == []


async def test_the_handler_runs_in_the_publishers_trace_and_its_success_is_an_ack(js, running):
    recorder, letters, consumer = running
    setup_sdk_tracing()
    event = saved()
    with trace.get_tracer("test").start_as_current_span("publisher.side") as parent:
        await publish_event(js, SUBJECT, event)
    while not recorder.calls:
        await recorder.changed.wait()
        recorder.changed.clear()
    seen, ctx, current = recorder.calls[0]
    assert seen == event and ctx.subject == SUBJECT and ctx.deliveries == 1
    assert ctx.span.get_span_context() == current  # ctx.span is the current span in the handler
    assert current.trace_id == parent.get_span_context().trace_id
    assert ctx.span.parent is not None and ctx.span.parent.span_id == parent.get_span_context().span_id
    assert ctx.span.name == "test.handle" and ctx.span.attributes["artery.step"] == 1
    await wait_until(lambda: consumer.stats.processed >= 1)
    assert letters.empty()


async def test_what_the_handler_raises_is_the_messages_outcome(js, running):
    recorder, letters, consumer = running
    conflict, bug, outage = (
        saved(uri="file:///conflict"),
        saved(uri="file:///bug"),
        saved(uri="file:///outage"),
    )
    for event in (conflict, bug, outage):
        await publish_event(js, SUBJECT, event)
    found = {}
    for _ in range(2):
        letter = await asyncio.wait_for(letters.get(), 20)
        found[letter.kind] = letter
    # InvalidMessage: dead-lettered at once, with the handler's kind and the event's id.
    assert found["step_conflict"].original_id == conflict.id
    assert found["step_conflict"].reason == "another adapter is stored at this step"
    assert recorder.deliveries(conflict) == [1]
    # A bug: nakked and redelivered, then poison at max_deliveries (2).
    assert "a bug" in found["poison"].reason
    assert recorder.deliveries(bug) == [1, 2]
    # An outage: nakked, and the redelivery succeeds; never a dead letter.
    while recorder.deliveries(outage) != [1, 2]:
        recorder.changed.clear()
        await asyncio.wait_for(recorder.changed.wait(), 20)
    await wait_until(lambda: consumer.stats.processed >= 1)
    assert letters.empty()
