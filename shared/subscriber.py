"""A typed subscriber: what every service does with a message before its own work, in one place.

A service's handler is ``async def handle(event: SomeEvent, ctx: Delivery) -> None``. Before it
runs, the subscriber has

- decoded the payload into the event type (``codec.EventDecoder``: a ``decode`` or ``validation``
  dead letter when it cannot), and run the service's own checks on it;
- checked that the subject names the payload's project and model (NATS permissions scope an agent
  to its project's subjects, so a payload naming another project is ``subject_mismatch``);
- opened the handler's span, the child of the span that published the message
  (``tracing.continue_trace``), with links to the spans the message names when asked.

What the handler raises is the message's outcome, which ``consumer.DurableConsumer`` turns into
ack / nak with delay / dead letter (``errors.disposition``); an ``InvalidMessage`` without the
refused event's id gets it here. Three batch forms feed a ``DurableConsumer``: ``one_at_a_time``
(stream order; after an outage the rest of the batch waits too), ``concurrently``, and ``batched``
(every message decoded and checked, then the valid ones handed over together: one transaction
per batch).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from nats.aio.msg import Msg
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.util.types import AttributeValue

from artery.shared.codec import CONTENT_TYPE, EventDecoder
from artery.shared.consumer import BatchHandler
from artery.shared.errors import DependencyUnavailable, InvalidMessage
from artery.shared.tracing import continue_trace, extract, extract_links, tracer


class Addressed(Protocol):
    """An event of one project's model, under its own id (every streamed event is one)."""

    @property
    def id(self) -> str: ...
    @property
    def project(self) -> str: ...
    @property
    def model(self) -> str: ...


E = TypeVar("E", bound=Addressed)
#: A span's attributes (a None value is left out).
Attributes = Mapping[str, AttributeValue | None]
T = TypeVar("T")

Outcome = BaseException | None
#: A handler of one event: its outcome is what it raises (nothing: done).
Handler = Callable[[E, "Delivery"], Awaitable[None]]
#: A handler of a batch of checked events: one outcome per item, in order.
BatchOf = Callable[[list[tuple[T, "Delivery"]]], Awaitable[Sequence[Outcome]]]


@dataclass
class Delivery:
    """What a handler knows of its message besides the event."""

    msg: Msg
    #: The handler's span (the subscriber's, once opened; not recording before).
    span: trace.Span = field(default=trace.INVALID_SPAN)

    @property
    def subject(self) -> str:
        return self.msg.subject

    @property
    def headers(self) -> Mapping[str, str]:
        return self.msg.headers or {}

    @property
    def deliveries(self) -> int:
        """Which delivery of the message this is (1: the first)."""
        return self.msg.metadata.num_delivered or 1

    @property
    def stream_seq(self) -> int:
        return self.msg.metadata.sequence.stream or 0

    @property
    def parent(self) -> otel_context.Context:
        """The trace context of the span that published the message."""
        return extract(self.msg.headers)

    async def in_progress(self) -> None:
        """Ask JetStream not to redeliver yet: the work takes a while."""
        await self.msg.in_progress()


class Subscriber(Generic[E]):
    """Decode, check, trace: the typed front of a service's durable consumer."""

    def __init__(
        self,
        event_type: Any,
        *,
        service: str,
        span: str,
        subject: Callable[[E], str] | None = None,
        sent_as: str = "published",
        attributes: Callable[[E], Attributes] | None = None,
        check: Callable[[E], None] | None = None,
        decode: Callable[[Msg], E] | None = None,
        accept: Callable[[E], bool] | None = None,
        links: bool = False,
    ) -> None:
        """``subject``: the subject the event must arrive on (None: not checked here);
        ``sent_as``: the verb of the mismatch's reason; ``check``: the service's own rules,
        raising ``InvalidMessage``; ``decode``: a decoder of the whole message, for a service
        whose rules need more than the payload; ``accept``: events to handle (the others are
        acked untouched, with no span); ``links``: link the span to those the message names."""
        self.service = service
        self.span_name = span
        self.tracer = tracer(service)
        self._decoder = EventDecoder(event_type)
        self._subject = subject
        self._sent_as = sent_as
        self._attributes = attributes
        self._check = check
        self._decode = decode
        self._accept = accept
        self._links = links

    def decode(self, msg: Msg) -> E:
        """The message's event, checked; ``InvalidMessage`` (a dead letter) when it is not one."""
        if self._decode is not None:
            event: E = self._decode(msg)
        else:
            event = self._decoder.decode(msg.data, (msg.headers or {}).get(CONTENT_TYPE))
        try:
            if self._check is not None:
                self._check(event)
            if self._subject is not None and msg.subject != self._subject(event):
                raise InvalidMessage(
                    "subject_mismatch", f"{event.project}/{event.model} {self._sent_as} on {msg.subject}"
                )
        except InvalidMessage as exc:
            exc.original_id = exc.original_id or event.id
            raise
        return event

    def attributes(self, event: E) -> Attributes | None:
        """The span's attributes for ``event``."""
        return None if self._attributes is None else self._attributes(event)

    @contextlib.contextmanager
    def span(self, delivery: Delivery, attributes: Attributes | None = None) -> Iterator[trace.Span]:
        """The handler's span, current while open: the child of the message's publisher."""
        with continue_trace(
            self.tracer,
            self.span_name,
            delivery.headers,
            attributes=attributes,
            links=extract_links(delivery.headers) if self._links else (),
        ) as span:
            delivery.span = span
            yield span

    async def deliver(self, msg: Msg, handler: Handler[E]) -> Outcome:
        """One message through decode, checks, span and ``handler``: its outcome."""
        event: E | None = None
        try:
            event = self.decode(msg)
            if self._accept is not None and not self._accept(event):
                return None
            delivery = Delivery(msg)
            with self.span(delivery, self.attributes(event)):
                await handler(event, delivery)
            return None
        except InvalidMessage as exc:
            if event is not None:
                exc.original_id = exc.original_id or event.id
            return exc
        except Exception as exc:  # this message's outcome alone (errors.disposition)
            return exc

    def one_at_a_time(self, handler: Handler[E]) -> BatchHandler:
        """In stream order; after an outage the rest of the batch waits too (same outcome)."""

        async def handle_batch(msgs: Sequence[Msg]) -> list[Outcome]:
            outcomes: list[Outcome] = []
            for msg in msgs:
                if outcomes and isinstance(outcomes[-1], DependencyUnavailable):
                    outcomes.append(outcomes[-1])
                    continue
                outcomes.append(await self.deliver(msg, handler))
            return outcomes

        return handle_batch

    def concurrently(self, handler: Handler[E]) -> BatchHandler:
        """Every message of the batch at once, each with its own outcome."""

        async def handle_batch(msgs: Sequence[Msg]) -> list[Outcome]:
            return list(await asyncio.gather(*(self.deliver(msg, handler) for msg in msgs)))

        return handle_batch

    def batched(self, handler: BatchOf[T], keep: Callable[[E, Delivery], T]) -> BatchHandler:
        """Every message decoded and checked, then the valid ones handed to ``handler`` together.
        ``keep`` turns each event into what the handler needs as soon as it is decoded, so that a
        batch of large events is never held decoded all at once. No span is opened: the handler
        opens each item's (``span``) when it works on it."""

        async def handle_batch(msgs: Sequence[Msg]) -> list[Outcome]:
            outcomes: list[Outcome] = [None] * len(msgs)
            items: list[tuple[T, Delivery]] = []
            positions: list[int] = []
            for position, msg in enumerate(msgs):
                try:
                    delivery = Delivery(msg)
                    items.append((keep(self.decode(msg), delivery), delivery))
                    positions.append(position)
                except Exception as exc:  # this message's outcome alone
                    outcomes[position] = exc
            if items:
                for position, outcome in zip(positions, await handler(items), strict=True):
                    outcomes[position] = outcome
            return outcomes

        return handle_batch
