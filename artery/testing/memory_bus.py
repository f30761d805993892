"""An in-memory double of the JetStream a service's consume loop talks to: the service tier.

A service's plumbing (``shared.subscriber`` decoding, checking and tracing; ``shared.consumer``
turning outcomes into ack, nak and dead letters) runs here on messages that never left the
process, so its rules are checked in milliseconds and without a server. It is a double, not the
real path: every rule it exercises is also exercised on a real nats-server
(``tests/test_consumer_subscriber.py`` and the integration tier).

What it keeps is what the consume loop reads and does: a message's subject, payload, headers,
delivery count and stream sequence; its settlement (``ack`` / ``nak`` / ``term``, in order); and
every publish (a dead letter, an event a handler emits), in order. It can be made unreachable,
as NATS is during a reconnect: every publish then times out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import msgspec

from artery.shared.bus import event_headers
from artery.shared.codec import JSON, encode


@dataclass
class Published:
    subject: str
    data: bytes
    headers: dict[str, str]


@dataclass
class MemoryJetStream:
    """Records every publish and answers with a stream sequence, as a stream's ack does."""

    unreachable: bool = False
    published: list[Published] = field(default_factory=list)
    #: Every publish tried, those that timed out included.
    publish_attempts: int = 0

    async def publish(
        self,
        subject: str,
        payload: bytes = b"",
        timeout: float | None = None,
        stream: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> SimpleNamespace:
        self.publish_attempts += 1
        if self.unreachable:
            raise TimeoutError("nats: timeout")
        self.published.append(Published(subject, payload, dict(headers or {})))
        return SimpleNamespace(stream=stream or "memory", seq=len(self.published), duplicate=False)

    def on(self, subject: str, event_type: Any) -> list[Any]:
        """The events published on ``subject``, decoded as ``event_type`` (JSON payloads)."""
        return [msgspec.json.decode(p.data, type=event_type) for p in self.published if p.subject == subject]


class MemoryMsg:
    """A delivered message: what ``Msg`` offers the consume loop, and how it was settled."""

    def __init__(
        self,
        subject: str,
        data: bytes,
        headers: dict[str, str] | None = None,
        *,
        stream: str = "memory",
        seq: int = 1,
        delivered: int = 1,
    ) -> None:
        self.subject, self.data, self.headers = subject, data, dict(headers or {})
        self.metadata = SimpleNamespace(
            num_pending=0, num_delivered=delivered, stream=stream, sequence=SimpleNamespace(stream=seq)
        )
        self.settled: list[str] = []

    @classmethod
    def of(cls, subject: str, event: Any, **kwargs: Any) -> MemoryMsg:
        """``event`` as a publisher sends it: JSON, with the standard headers."""
        return cls(subject, encode(event, JSON), event_headers(event, JSON), **kwargs)

    def redelivered(self) -> MemoryMsg:
        """The same message, delivered once more (after a nak, or ack_wait passing)."""
        meta = self.metadata
        return MemoryMsg(
            self.subject,
            self.data,
            self.headers,
            stream=meta.stream,
            seq=meta.sequence.stream,
            delivered=meta.num_delivered + 1,
        )

    async def ack(self) -> None:
        self.settled.append("ack")

    async def nak(self, delay: float | None = None) -> None:
        self.settled.append("nak")

    async def term(self) -> None:
        self.settled.append("term")

    async def in_progress(self) -> None:
        self.settled.append("in_progress")
