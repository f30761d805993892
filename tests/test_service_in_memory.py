"""A service's consume loop on the in-memory bus (``artery.testing.memory_bus``): the service tier.

The same rules ``tests/test_consumer_subscriber.py`` checks on a real nats-server, in
milliseconds: the typed subscriber decodes and checks, the handler's outcome becomes ack, nak or a
dead letter with its kind and the refused event's id, and a dead letter that cannot be published
leaves its message for redelivery."""

from __future__ import annotations

import pytest

from artery.schemas import CheckpointSaved, DeadLetter
from artery.shared import subjects
from artery.shared.consumer import ConsumerOptions, DurableConsumer
from artery.shared.errors import DependencyUnavailable, InvalidMessage
from artery.shared.subscriber import Delivery, Subscriber
from artery.testing.memory_bus import MemoryJetStream, MemoryMsg
from tests.helpers import saved

SERVICE = "memory-test"
SUBJECT = subjects.checkpoint("saved", "proj", "agent")
MAX_DELIVERIES = 3


class Handler:
    """Behaves as the event's ``uri`` says, and records what it was given."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, int]] = []

    async def __call__(self, event: CheckpointSaved, ctx: Delivery) -> None:
        self.seen.append((event.id, ctx.subject, ctx.deliveries))
        if event.uri == "file:///conflict":
            raise InvalidMessage("step_conflict", "another adapter is stored at this step")
        if event.uri == "file:///outage":
            raise DependencyUnavailable("the database is away")
        if event.uri == "file:///bug":
            raise RuntimeError("a bug")


def consumer(js: MemoryJetStream, handler: Handler) -> DurableConsumer:
    subscriber: Subscriber[CheckpointSaved] = Subscriber(
        CheckpointSaved,
        service=SERVICE,
        span="memory.handle",
        subject=lambda e: subjects.checkpoint("saved", e.project, e.model),
    )
    return DurableConsumer(
        js,  # type: ignore[arg-type]  # the double offers what the consume loop uses
        service=SERVICE,
        stream=subjects.CHECKPOINTS,
        durable=SERVICE,
        filter_subject=SUBJECT,
        handler=subscriber.one_at_a_time(handler),
        options=ConsumerOptions(backoff_initial_s=0.0, backoff_max_s=0.0, max_deliveries=MAX_DELIVERIES),
    )


def letters(js: MemoryJetStream) -> list[DeadLetter]:
    return js.on(subjects.dead_letter(SERVICE), DeadLetter)


@pytest.fixture
def js() -> MemoryJetStream:
    return MemoryJetStream()


async def test_an_event_on_its_subject_reaches_the_handler_and_is_acked(js):
    handler, event = Handler(), saved()
    msg = MemoryMsg.of(SUBJECT, event)
    await consumer(js, handler).process([msg])
    assert handler.seen == [(event.id, SUBJECT, 1)]
    assert msg.settled == ["ack"] and letters(js) == []


async def test_what_is_not_an_event_or_names_another_model_is_a_dead_letter(js):
    handler, other = Handler(), saved(model="other")
    garbage = MemoryMsg(SUBJECT, b"not json", seq=1)
    misrouted = MemoryMsg.of(SUBJECT, other, seq=2)
    await consumer(js, handler).process([garbage, misrouted])
    assert handler.seen == []  # neither reached the handler
    assert garbage.settled == ["term"] and misrouted.settled == ["term"]
    decode, mismatch = letters(js)
    assert decode.kind == "decode"
    assert mismatch.kind == "subject_mismatch" and mismatch.original_id == other.id
    assert "proj/other" in mismatch.reason


async def test_a_refusal_is_a_dead_letter_at_once_an_outage_is_retried(js):
    handler, refused, away = Handler(), saved(uri="file:///conflict"), saved(uri="file:///outage")
    first, second = MemoryMsg.of(SUBJECT, refused, seq=1), MemoryMsg.of(SUBJECT, away, seq=2)
    await consumer(js, handler).process([first, second])
    assert first.settled == ["term"] and second.settled == ["nak"]
    [letter] = letters(js)
    assert (letter.kind, letter.original_id) == ("step_conflict", refused.id)
    # An outage is never a dead letter, however often it is redelivered.
    again = second
    for _ in range(MAX_DELIVERIES + 1):
        again = again.redelivered()
        await consumer(js, handler).process([again])
        assert again.settled == ["nak"]
    assert len(letters(js)) == 1


async def test_a_bug_is_retried_then_dead_lettered_as_poison(js):
    handler, event = Handler(), saved(uri="file:///bug")
    msg = MemoryMsg.of(SUBJECT, event)
    outcomes = []
    for _ in range(MAX_DELIVERIES):
        await consumer(js, handler).process([msg])
        outcomes.append(msg.settled[-1])
        msg = msg.redelivered()
    assert outcomes == ["nak", "nak", "term"]
    [letter] = letters(js)
    assert letter.kind == "poison" and "a bug" in letter.reason
    assert [deliveries for _, _, deliveries in handler.seen] == [1, 2, 3]


async def test_a_dead_letter_that_cannot_be_published_leaves_the_message_unsettled():
    js = MemoryJetStream(unreachable=True)
    msg = MemoryMsg(SUBJECT, b"not json")
    await consumer(js, Handler()).process([msg])
    assert msg.settled == []  # redelivered after ack_wait, when NATS is back
    assert js.published == []
