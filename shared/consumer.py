"""A durable pull consumer that turns a handler's outcome into ack / nak / dead letter.

This is the one place where errors become JetStream outcomes (``errors.disposition``):
- success: ack;
- ``InvalidMessage``: a ``DeadLetter`` with the reason is published to ``artery.dlq.<service>``,
  then the message is terminated (never redelivered);
- ``DependencyUnavailable``: nak with a growing delay, and the loop itself backs off, so an
  outage is waited out without losing or re-dead-lettering anything;
- any other exception (a bug): nak with delay, and dead-lettered as ``poison`` once it has been
  delivered ``max_deliveries`` times, so one bad message cannot stall a service forever.

A service does not write the batch handler itself: ``shared.subscriber.Subscriber`` decodes and
checks each message, opens its span and calls the service's typed ``handle(event, ctx)``.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from artery.schemas import DeadLetter
from artery.schemas.base import NAME_PATTERN
from artery.schemas.deadletter import UNKNOWN
from artery.shared import subjects
from artery.shared.bus import CONTENT_TYPE, MSG_ID, publish_event
from artery.shared.codec import event_id
from artery.shared.errors import DependencyUnavailable, Disposition, InvalidMessage, disposition
from artery.shared.logs import get_logger
from artery.shared.metrics import CONSUMER_LAG, DEAD_LETTERS, MESSAGES

if TYPE_CHECKING:
    from artery.shared.db import ServicePool

log = get_logger(__name__)

#: A batch handler returns one outcome per message: None (done) or the exception it met.
BatchHandler = Callable[[Sequence[Msg]], Awaitable[Sequence[BaseException | None]]]

_NAME = re.compile(NAME_PATTERN)
_DLQ_NAMESPACE = uuid.UUID("6f1d4b8e-5c55-4a53-9d0e-61727465727a")


@dataclass
class ConsumerStats:
    processed: int = 0
    dead_lettered: dict[str, int] = field(default_factory=dict)
    retried: int = 0


@dataclass
class ConsumerOptions:
    batch_size: int = 500
    fetch_timeout_s: float = 1.0
    ack_wait_s: float = 30.0
    max_deliveries: int = 20
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 10.0
    max_ack_pending: int = 20_000
    dlq_payload_bytes: int = 64 * 1024

    @classmethod
    def from_settings(cls, settings: object) -> ConsumerOptions:
        """The options a service's settings name (``batch_size``, ``fetch_timeout_s``, ...);
        the defaults above for those it does not."""
        names = ("batch_size", "fetch_timeout_s", "ack_wait_s", "max_deliveries", "backoff_max_s")
        return cls(**{name: getattr(settings, name) for name in names if hasattr(settings, name)})


class DurableConsumer:
    def __init__(
        self,
        js: JetStreamContext,
        *,
        service: str,
        stream: subjects.StreamSpec,
        durable: str,
        filter_subject: str,
        handler: BatchHandler,
        options: ConsumerOptions | None = None,
    ):
        self.js = js
        self.service = service
        self.stream = stream
        self.durable = durable
        self.filter_subject = filter_subject
        self.handler = handler
        self.options = options or ConsumerOptions()
        self.stats = ConsumerStats()
        self._backoff = self.options.backoff_initial_s
        self._stopping = asyncio.Event()
        self._sub: JetStreamContext.PullSubscription | None = None

    async def subscribe(self) -> JetStreamContext.PullSubscription:
        o = self.options
        return await self.js.pull_subscribe(
            self.filter_subject,
            durable=self.durable,
            stream=self.stream.name,
            config=ConsumerConfig(
                ack_policy=AckPolicy.EXPLICIT,
                deliver_policy=DeliverPolicy.ALL,
                ack_wait=o.ack_wait_s,
                max_deliver=-1,  # we decide when to give up (dead letter), not the server
                max_ack_pending=o.max_ack_pending,
            ),
        )

    def stop(self) -> None:
        self._stopping.set()

    async def start(self) -> None:
        """Create (or bind to) the durable consumer; ``run`` then processes messages."""
        await self._subscribed()

    async def _subscribed(self) -> JetStreamContext.PullSubscription:
        self._sub = await self.subscribe()
        log.info("consuming", stream=self.stream.name, durable=self.durable)
        return self._sub

    async def run(self) -> None:
        sub = self._sub if self._sub is not None else await self._subscribed()
        while not self._stopping.is_set():
            try:
                msgs = await sub.fetch(self.options.batch_size, timeout=self.options.fetch_timeout_s)
            except (TimeoutError, NatsTimeoutError):
                CONSUMER_LAG.labels(self.service, self.durable).set(0)  # nothing left to deliver
                continue
            except Exception as exc:  # connection trouble: the client reconnects by itself
                log.warning("fetch failed", error=repr(exc))
                await self._sleep(self.options.backoff_initial_s)
                continue
            await self.process(msgs)

    async def process(self, msgs: Sequence[Msg]) -> None:
        try:
            outcomes = list(await self.handler(msgs))
        except Exception as exc:
            outcomes = [exc] * len(msgs)
        outage: BaseException | None = None  # the first sign that NATS or a dependency is away
        for msg, outcome in zip(msgs, outcomes, strict=True):
            if isinstance(outcome, DependencyUnavailable):
                outage = outage or outcome
            try:
                await self._settle(msg, outcome)
            except Exception as exc:
                # The ack, nak or dead letter did not reach NATS (a reconnect, a publish timeout):
                # the message stays unacknowledged and is redelivered after ack_wait, and a dead
                # letter published twice keeps its fixed id. The loop itself must go on.
                outage = outage or exc
                log.warning(
                    "message not settled; it will be redelivered", subject=msg.subject, error=repr(exc)
                )
        if outage is not None:
            log.warning("dependency unavailable; backing off", seconds=self._backoff, error=str(outage))
            await self._sleep(self._backoff)
            self._backoff = min(self._backoff * 2, self.options.backoff_max_s)
        else:
            self._backoff = self.options.backoff_initial_s

    async def _settle(self, msg: Msg, outcome: BaseException | None) -> None:
        action = disposition(outcome)
        CONSUMER_LAG.labels(self.service, self.durable).set(msg.metadata.num_pending or 0)
        if action is Disposition.ACK:
            self.stats.processed += 1
            await msg.ack()
            MESSAGES.labels(self.service, self.durable, "acked").inc()
            return
        if action is Disposition.TERMINATE_AND_DEAD_LETTER:
            assert isinstance(outcome, InvalidMessage)
            await self.dead_letter(msg, outcome)
            return
        deliveries = msg.metadata.num_delivered or 1
        if not isinstance(outcome, DependencyUnavailable):
            log.error("handler failed", error=repr(outcome), deliveries=deliveries)
            if deliveries >= self.options.max_deliveries:
                await self.dead_letter(
                    msg,
                    InvalidMessage("poison", f"failed {deliveries} times; last error: {outcome!r}"),
                )
                return
        self.stats.retried += 1
        await msg.nak(delay=min(self._backoff * deliveries, self.options.backoff_max_s))
        MESSAGES.labels(self.service, self.durable, "nacked").inc()

    async def dead_letter(self, msg: Msg, error: InvalidMessage) -> None:
        """Publish the reason and the (possibly cut) payload, then terminate the message."""
        meta = msg.metadata
        project, model = _names_from_subject(msg.subject)
        letter = dead_letter_event(
            msg,
            error,
            letter_id=str(uuid.uuid5(_DLQ_NAMESPACE, f"{meta.stream}:{meta.sequence.stream}")),
            service=self.service,
            project=project,
            model=model,
            payload_limit=self.options.dlq_payload_bytes,
            stream=meta.stream,
            stream_seq=meta.sequence.stream,
        )
        # The dead letter is durable before the original is terminated: a crash in between
        # redelivers the original, and the dead letter's fixed id de-duplicates the second one.
        await publish_event(self.js, subjects.dead_letter(self.service), letter)
        await msg.term()
        self.stats.dead_lettered[error.kind] = self.stats.dead_lettered.get(error.kind, 0) + 1
        MESSAGES.labels(self.service, self.durable, "dead_lettered").inc()
        DEAD_LETTERS.labels(self.service, error.kind).inc()
        log.warning(
            "dead-lettered",
            kind=error.kind,
            reason=error.reason[:300],
            subject=msg.subject,
            stream_seq=meta.sequence.stream,
        )

    async def _sleep(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self._stopping.wait(), timeout=seconds)
        except TimeoutError:
            pass


def dead_letter_event(
    msg: Msg,
    error: InvalidMessage,
    *,
    letter_id: str,
    service: str,
    project: str,
    model: str,
    payload_limit: int,
    stream: str | None = None,
    stream_seq: int | None = None,
) -> DeadLetter:
    """The ``DeadLetter`` for a rejected message, streamed or core (request/reply): the reason,
    the headers and the payload, both cut to bounded sizes."""
    headers = dict(msg.headers or {})
    return DeadLetter(
        id=letter_id,
        project=project,
        model=model,
        service=service,
        reason=error.reason,
        kind=error.kind,
        subject=msg.subject,
        stream=stream,
        stream_seq=stream_seq,
        original_id=error.original_id or headers.get(MSG_ID) or event_id(msg.data, headers.get(CONTENT_TYPE)),
        headers={k: v[:1024] for k, v in list(headers.items())[:32]},
        content_type=headers.get(CONTENT_TYPE),
        payload=msg.data[:payload_limit],
        payload_truncated=len(msg.data) > payload_limit,
    )


def _names_from_subject(subject: str) -> tuple[str, str]:
    """Project and model of a streamed subject: its last two tokens (``artery.<family>...<p>.<m>``)."""
    tokens = subject.split(".")
    if len(tokens) < 4 or tokens[0] != subjects.PREFIX:
        return UNKNOWN, UNKNOWN
    project, model = subjects.name_of(tokens[-2]), subjects.name_of(tokens[-1])
    return (project if _NAME.match(project) else UNKNOWN, model if _NAME.match(model) else UNKNOWN)


class ConsumingService:
    """A service whose work arrives through durable consumers and whose rows go through a
    ``ServicePool``: the start / run / stop / close that ``shared.runtime`` drives.

    Subclasses set ``self.consumers`` (one or more fetch loops) and ``self.db``, and extend
    ``start`` for what must be ready before the first message.
    """

    consumers: list[DurableConsumer]
    db: ServicePool

    @property
    def consumer(self) -> DurableConsumer:
        """The first (usually only) consumer: its options and stats."""
        return self.consumers[0]

    async def start(self) -> None:
        for consumer in self.consumers:
            await consumer.start()

    async def run(self) -> None:
        await asyncio.gather(*(consumer.run() for consumer in self.consumers))

    def stop(self) -> None:
        for consumer in self.consumers:
            consumer.stop()

    async def close(self) -> None:
        await self.db.close()
