"""The replica side of the control protocol: answer pause/resume, and keep a heartbeat in KV.

``ControlServer`` subscribes to the pause and resume subjects of its project/model with plain
core subscriptions, not a queue group: every replica must receive every request, and each
answers on the request's reply subject, so the trainer gathers one ack per replica.

Bad input (undecodable, wrong event type, another project/model, an invalid lease) never
crashes the replica. It is answered with an ack that carries ``error`` (when the request has a
reply subject, so the trainer fails at once instead of timing out) and recorded as a
``DeadLetter`` on ``artery.dlq.inference`` (the DLQ stream captures core publishes too). The
dead letter's id is derived from the rejected bytes, so N replicas rejecting the same request
leave one dead letter, not N (JetStream's duplicate window).

``ReplicaRegistry`` writes this replica's ``ReplicaInfo`` under its id in the replica bucket
every ``heartbeat_s``; the bucket's TTL removes the entries of replicas that died, which is how
the trainer knows whose ack to wait for.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import re
import uuid
from collections.abc import Callable

import msgspec
import nats
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from artery.schemas import PauseAck, PauseInference, ReplicaInfo, ResumeAck, ResumeInference
from artery.schemas.base import new_event_id, utcnow
from artery.services.inference.pause import PauseGate
from artery.shared import subjects
from artery.shared.bus import CONTENT_TYPE, REPLICA_TTL_S, event_headers
from artery.shared.codec import EventDecoder, encode
from artery.shared.consumer import dead_letter_event
from artery.shared.errors import InvalidMessage
from artery.shared.logs import get_logger
from artery.shared.tasks import cancel_and_wait

log = get_logger(__name__)

SERVICE = "inference"
#: Characters NATS allows in a KV key (the replica id is the key).
_KV_KEY = re.compile(r"^[-/_=a-zA-Z0-9]+(\.[-/_=a-zA-Z0-9]+)*$")
_DLQ_NAMESPACE = uuid.UUID("0b6f5a7e-3c1d-4e0a-9f57-636f6e74726c")
_DLQ_PAYLOAD_BYTES = 16 * 1024
_pause_decoder = EventDecoder(PauseInference)
_resume_decoder = EventDecoder(ResumeInference)


def check_replica_id(replica_id: str) -> str:
    if not _KV_KEY.match(replica_id):
        raise ValueError(f"replica id {replica_id!r} is not a valid KV key ([-/_=.a-zA-Z0-9])")
    return replica_id


class ControlServer:
    def __init__(
        self,
        nc: nats.NATS,
        gate: PauseGate,
        *,
        replica_id: str,
        project: str,
        model: str,
        drain_timeout_s: float = 60.0,
        on_change: Callable[[], object] | None = None,
    ):
        self.nc = nc
        self.gate = gate
        self.replica_id = check_replica_id(replica_id)
        self.project = project
        self.model = model
        self.drain_timeout_s = drain_timeout_s
        #: Called after every pause/resume (the registry's ``beat``, so KV shows it promptly).
        self.on_change = on_change
        self._subs: list[Subscription] = []

    async def start(self) -> None:
        # Each subscription runs its callback serially: pauses (and renewals) are handled in
        # order, while a resume is never stuck behind a pause that is still draining.
        self._subs = [
            await self.nc.subscribe(subjects.control("pause", self.project, self.model), cb=self._on_pause),
            await self.nc.subscribe(subjects.control("resume", self.project, self.model), cb=self._on_resume),
        ]
        await self.nc.flush()  # subscribed at the server before anyone is told we are live

    async def stop(self) -> None:
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._subs = []

    async def _on_pause(self, msg: Msg) -> None:
        lease_id = _lease_hint(msg.data)
        try:
            request = self._decode(_pause_decoder, msg)
            lease_id = request.lease_id
            result = await self.gate.pause(
                request.lease_id,
                request.lease_seconds,
                drain_timeout_s=self.drain_timeout_s,
                free_memory=request.free_memory,
            )
            error = None
            if result.still_running:
                error = f"{result.still_running} requests still running after {self.drain_timeout_s}s"
            ack = self._pause_ack(
                lease_id,
                paused=result.paused,
                expires_at=result.lease_expires_at,
                drained=result.drained,
                freed=result.freed_memory,
                error=error,
            )
        except InvalidMessage as exc:
            await self._dead_letter(msg, exc)
            ack = self._pause_ack(lease_id, paused=self.gate.paused, error=str(exc))
        except Exception as exc:  # a bug or a failing hook: answer, never take the replica down
            log.exception("pause handling failed")
            ack = self._pause_ack(lease_id, paused=self.gate.paused, error=f"internal: {exc!r}")
        await self._reply(msg, ack)

    async def _on_resume(self, msg: Msg) -> None:
        lease_id = _lease_hint(msg.data)
        error = None
        try:
            request = self._decode(_resume_decoder, msg)
            lease_id = request.lease_id
            resumed = await self.gate.resume(request.lease_id)
        except InvalidMessage as exc:
            await self._dead_letter(msg, exc)
            resumed, error = not self.gate.paused, str(exc)
        except Exception as exc:
            log.exception("resume handling failed")
            resumed, error = not self.gate.paused, f"internal: {exc!r}"
        # ``resumed`` says whether requests are admitted now, whatever the outcome of this request.
        ack = ResumeAck(
            id=new_event_id(),
            project=self.project,
            model=self.model,
            replica_id=self.replica_id,
            lease_id=lease_id,
            resumed=resumed,
            error=error,
        )
        await self._reply(msg, ack)

    def _decode(self, decoder: EventDecoder, msg: Msg):
        event = decoder.decode(msg.data, (msg.headers or {}).get(CONTENT_TYPE))
        if (event.project, event.model) != (self.project, self.model):
            raise InvalidMessage(
                "wrong_target", f"for {event.project}/{event.model}, not {self.project}/{self.model}"
            )
        return event

    def _pause_ack(self, lease_id: str, *, paused: bool, expires_at=None, drained=0, freed=False, error=None):
        return PauseAck(
            id=new_event_id(),
            project=self.project,
            model=self.model,
            replica_id=self.replica_id,
            lease_id=lease_id,
            paused=paused,
            lease_expires_at=expires_at or utcnow(),
            drained_requests=drained,
            freed_memory=freed,
            error=error,
        )

    async def _reply(self, msg: Msg, ack: PauseAck | ResumeAck) -> None:
        # A request without a reply subject is fire-and-forget: the gate acted, nobody waits.
        if msg.reply:
            try:
                await self.nc.publish(msg.reply, encode(ack), headers=event_headers(ack))
            except Exception as exc:  # the trainer times out and names us; nothing more to do
                log.warning("control reply failed", error=repr(exc))
        if self.on_change is not None:  # after the reply: the trainer is not kept waiting on KV
            try:
                result = self.on_change()
                if asyncio.iscoroutine(result):
                    await result
            except Exception as exc:
                log.warning("on_change after control request failed", error=repr(exc))

    async def _dead_letter(self, msg: Msg, error: InvalidMessage) -> None:
        digest = hashlib.sha256(msg.subject.encode() + b"\0" + msg.data).hexdigest()
        letter = dead_letter_event(
            msg,
            error,
            letter_id=str(uuid.uuid5(_DLQ_NAMESPACE, digest)),
            service=SERVICE,
            project=self.project,
            model=self.model,
            payload_limit=_DLQ_PAYLOAD_BYTES,
        )
        log.warning(
            "control request rejected", kind=error.kind, reason=error.reason[:300], subject=msg.subject
        )
        try:
            await self.nc.publish(
                subjects.dead_letter(SERVICE), encode(letter), headers=event_headers(letter)
            )
        except Exception as exc:
            log.warning("dead letter publish failed", error=repr(exc))


def _lease_hint(data: bytes) -> str:
    """The lease id of a request that may not decode, for the error ack (EventId: non-empty)."""
    try:
        value = msgspec.json.decode(data).get("lease_id")
        if isinstance(value, str) and 0 < len(value) <= 128 and "\x00" not in value:
            return value
    except Exception:
        pass
    return "_invalid"


class ReplicaRegistry:
    """This replica's heartbeat in the replica KV bucket; the key is deleted on a clean stop."""

    def __init__(
        self,
        js: JetStreamContext,
        gate: PauseGate,
        *,
        replica_id: str,
        project: str,
        model: str,
        engine: str,
        url: str,
        served: Callable[[], list[str]] = list,
        heartbeat_s: float = 5.0,
    ):
        if not 0 < heartbeat_s < REPLICA_TTL_S:
            raise ValueError(f"heartbeat_s must be in (0, {REPLICA_TTL_S}) or the entry expires")
        self.js = js
        self.gate = gate
        self.replica_id = check_replica_id(replica_id)
        self.project = project
        self.model = model
        self.engine = engine
        self.url = url
        self.served = served
        self.heartbeat_s = heartbeat_s
        self._key = subjects.replica_key(project, model, self.replica_id)
        self._kv: KeyValue | None = None
        self._task: asyncio.Task | None = None
        self._stopping = asyncio.Event()

    def info(self) -> ReplicaInfo:
        return ReplicaInfo(
            replica_id=self.replica_id,
            project=self.project,
            model=self.model,
            engine=self.engine,
            url=self.url,
            served=list(self.served()),
            paused=self.gate.paused,
            lease_id=self.gate.governing_lease(),
            heartbeat_at=utcnow(),
        )

    async def beat(self) -> None:
        if self._kv is None:
            self._kv = await self.js.key_value(subjects.REPLICAS_BUCKET)
        await self._kv.put(self._key, encode(self.info()))

    async def start(self) -> None:
        """Register now (so a trainer sees us before the first interval), then keep beating."""
        await self.beat()
        self._stopping.clear()
        self._task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        # Ends on ``_stopping`` too, not on cancellation alone: a cancel that lands as a beat's
        # reply arrives can be swallowed inside nats-py's request (asyncio.wait_for on 3.11), and
        # ``stop`` then waited for a loop that went on beating (a test teardown hung 300 s).
        while not self._stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self.heartbeat_s)
                return
            try:
                await self.beat()
            except Exception as exc:  # a NATS outage: keep trying, the entry may expire meanwhile
                log.warning("heartbeat failed", replica_id=self.replica_id, error=repr(exc))

    async def stop(self) -> None:
        self._stopping.set()
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
        try:
            if self._kv is not None:
                await self._kv.delete(self._key)
        except Exception as exc:  # the TTL removes it anyway
            log.warning("replica deregistration failed", error=repr(exc))
