"""The trainer side of the control protocol: pause every live replica, renew, resume.

One request reaches every replica (they subscribe without a queue group); the acks come back
on one inbox (scatter-gather). Whom to wait for is read from the replica KV bucket, where live
replicas keep a heartbeat; a replica that is registered but does not ack in time fails the
pause, because training on a GPU that a replica is still using is what this protocol prevents.

Resuming is best effort by design: a replica that misses the resume still resumes when its
lease runs out, so ``resume_replicas`` reports stragglers instead of raising.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TypeVar

import nats
from nats.js import JetStreamContext

from artery.schemas import PauseAck, PauseInference, ReplicaInfo, ResumeAck, ResumeInference
from artery.schemas.base import new_event_id
from artery.shared import subjects
from artery.shared.bus import CONTENT_TYPE, event_headers
from artery.shared.codec import EventDecoder, encode
from artery.shared.errors import ArteryError, InvalidMessage
from artery.shared.kv import latest_values
from artery.shared.logs import get_logger
from artery.shared.tasks import cancel_and_wait

log = get_logger(__name__)

_replica_decoder = EventDecoder(ReplicaInfo)
_ack_decoders = {PauseAck: EventDecoder(PauseAck), ResumeAck: EventDecoder(ResumeAck)}
Ack = TypeVar("Ack", PauseAck, ResumeAck)


@dataclass(frozen=True)
class PauseOutcome:
    lease_id: str
    #: Replicas that the KV bucket listed as live when the pause was sent.
    live: list[str]
    #: Replicas that acked, paused and drained (including any that registered after the read).
    acked: dict[str, PauseAck]
    #: Live replicas that did not answer before the timeout.
    missing: list[str]
    #: Replicas that answered but could not pause cleanly: replica id -> the reason.
    failed: dict[str, str]
    elapsed_s: float

    @property
    def ok(self) -> bool:
        return not self.missing and not self.failed

    @property
    def nothing_to_pause(self) -> bool:
        """No replica was live: the trainer may train at once (and said so in the log)."""
        return not self.live


@dataclass(frozen=True)
class ResumeOutcome:
    lease_id: str
    live: list[str]
    acked: dict[str, ResumeAck]
    missing: list[str]
    #: Replicas that released this lease but stay paused under another one.
    still_paused: list[str]
    elapsed_s: float


class PauseFailed(ArteryError):
    """Some live replica did not pause in time; it is named, with the reason, in the message."""

    def __init__(self, outcome: PauseOutcome):
        parts = []
        if outcome.missing:
            parts.append(f"no ack from {', '.join(outcome.missing)}")
        parts.extend(f"{replica}: {reason}" for replica, reason in sorted(outcome.failed.items()))
        super().__init__(
            f"pause {outcome.lease_id} failed after {outcome.elapsed_s:.2f}s: {'; '.join(parts)}"
        )
        self.outcome = outcome


async def live_replicas(js: JetStreamContext, project: str, model: str) -> list[ReplicaInfo]:
    """Replicas of ``project``/``model`` with an unexpired heartbeat (expired keys are gone)."""
    found = await registered_replicas(js, subjects.replica_keys(project, model))
    return [
        r for r in found if (r.project, r.model) == (project, model)
    ]  # the key says so; the value must too


async def registered_replicas(js: JetStreamContext, keys: str = ">") -> list[ReplicaInfo]:
    """Every readable heartbeat whose key matches ``keys``; an unreadable one is logged and skipped."""
    found: list[ReplicaInfo] = []
    for key, value in (await latest_values(js, subjects.REPLICAS_BUCKET, keys)).items():
        try:
            found.append(_replica_decoder.decode(value))
        except InvalidMessage as exc:
            log.warning("unreadable replica entry", key=key, error=str(exc))
    return found


async def _scatter_gather(
    nc: nats.NATS,
    subject: str,
    request: PauseInference | ResumeInference,
    ack_type: type[Ack],
    expected: set[str],
    timeout_s: float,
) -> tuple[dict[str, Ack], float]:
    """Publish ``request`` once and collect one ``ack_type`` per replica until all expected answered."""
    started = time.monotonic()
    decoder = _ack_decoders[ack_type]
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)  # before the publish: the server orders both on one connection
    acks: dict[str, Ack] = {}
    try:
        await nc.publish(subject, encode(request), reply=inbox, headers=event_headers(request))
        deadline = started + timeout_s
        while not expected <= acks.keys():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                msg = await sub.next_msg(timeout=remaining)
            except nats.errors.TimeoutError:
                break
            if msg.headers and msg.headers.get("Status") == "503":  # no subscriber at all
                break
            try:
                ack: Ack = decoder.decode(msg.data, (msg.headers or {}).get(CONTENT_TYPE))
            except InvalidMessage as exc:
                log.warning("unreadable control ack", error=str(exc))
                continue
            if ack.lease_id == request.lease_id:
                acks[ack.replica_id] = ack
    finally:
        await sub.unsubscribe()
    return acks, time.monotonic() - started


async def pause_replicas(
    nc: nats.NATS,
    project: str,
    model: str,
    *,
    lease_seconds: float,
    requested_by: str,
    timeout_s: float = 30.0,
    lease_id: str | None = None,
    free_memory: bool = True,
    release_on_failure: bool = True,
) -> PauseOutcome:
    """Pause every live replica under one lease; raise ``PauseFailed`` naming any that did not.

    Passing the ``lease_id`` of a held lease renews it (that is all ``renew`` does). On failure
    the replicas that did pause are released at once (``release_on_failure``) instead of
    sitting out the lease. The request is sent even when no replica is registered, so one that
    is starting right now pauses too; the call then returns without waiting.
    """
    lease_id = lease_id or new_event_id()
    live = await live_replicas(nc.jetstream(), project, model)
    request = PauseInference(
        id=new_event_id(),
        project=project,
        model=model,
        lease_id=lease_id,
        lease_seconds=lease_seconds,
        requested_by=requested_by,
        free_memory=free_memory,
    )
    expected = {r.replica_id for r in live}
    acks, elapsed = await _scatter_gather(
        nc, subjects.control("pause", project, model), request, PauseAck, expected, timeout_s
    )
    failed = {rid: ack.error or "did not pause" for rid, ack in acks.items() if ack.error or not ack.paused}
    outcome = PauseOutcome(
        lease_id=lease_id,
        live=sorted(expected),
        acked={rid: ack for rid, ack in acks.items() if rid not in failed},
        missing=sorted(expected - acks.keys()),
        failed=failed,
        elapsed_s=elapsed,
    )
    if outcome.nothing_to_pause:
        log.info("no live inference replica; nothing to pause", project=project, model=model)
    if not outcome.ok:
        if release_on_failure:
            with contextlib.suppress(Exception):
                await resume_replicas(
                    nc, project, model, lease_id, requested_by=requested_by, timeout_s=min(timeout_s, 5.0)
                )
        raise PauseFailed(outcome)
    return outcome


async def renew(
    nc: nats.NATS,
    project: str,
    model: str,
    lease_id: str,
    *,
    lease_seconds: float,
    requested_by: str,
    timeout_s: float = 10.0,
    free_memory: bool = True,
) -> PauseOutcome:
    """Extend ``lease_id`` on every live replica (and pause any that joined since)."""
    return await pause_replicas(
        nc,
        project,
        model,
        lease_seconds=lease_seconds,
        requested_by=requested_by,
        timeout_s=timeout_s,
        lease_id=lease_id,
        free_memory=free_memory,
        release_on_failure=False,  # training is under way: keep whoever did renew paused
    )


async def resume_replicas(
    nc: nats.NATS,
    project: str,
    model: str,
    lease_id: str,
    *,
    requested_by: str,
    timeout_s: float = 10.0,
) -> ResumeOutcome:
    live = await live_replicas(nc.jetstream(), project, model)
    request = ResumeInference(
        id=new_event_id(), project=project, model=model, lease_id=lease_id, requested_by=requested_by
    )
    expected = {r.replica_id for r in live}
    acks, elapsed = await _scatter_gather(
        nc, subjects.control("resume", project, model), request, ResumeAck, expected, timeout_s
    )
    outcome = ResumeOutcome(
        lease_id=lease_id,
        live=sorted(expected),
        acked=acks,
        missing=sorted(expected - acks.keys()),
        still_paused=sorted(rid for rid, ack in acks.items() if not ack.resumed),
        elapsed_s=elapsed,
    )
    if outcome.missing:
        log.warning("replicas did not ack resume; their lease ends it", missing=outcome.missing)
    return outcome


@dataclass
class PauseLease:
    """What ``paused()`` yields: the lease held while the body runs, and how renewals went."""

    lease_id: str
    lease_seconds: float
    outcome: PauseOutcome
    renewals: int = 0
    renew_failures: list[str] = field(default_factory=list)


@contextlib.asynccontextmanager
async def paused(
    nc: nats.NATS,
    project: str,
    model: str,
    lease_seconds: float,
    *,
    requested_by: str,
    timeout_s: float = 30.0,
    free_memory: bool = True,
) -> AsyncIterator[PauseLease]:
    """Pause for the body, renewing every ``lease_seconds / 3``; resume after it, even on error.

    A renewal that fails is logged and recorded, not raised: the body (a training step) is
    already running, and the replicas that missed it resume on their own when the lease ends.
    """
    outcome = await pause_replicas(
        nc,
        project,
        model,
        lease_seconds=lease_seconds,
        requested_by=requested_by,
        timeout_s=timeout_s,
        free_memory=free_memory,
    )
    lease = PauseLease(lease_id=outcome.lease_id, lease_seconds=lease_seconds, outcome=outcome)

    async def keep_renewing() -> None:
        interval = lease_seconds / 3
        while True:
            await asyncio.sleep(interval)
            try:
                await renew(
                    nc,
                    project,
                    model,
                    lease.lease_id,
                    lease_seconds=lease_seconds,
                    requested_by=requested_by,
                    timeout_s=max(interval, 0.05),  # one more try remains before the lease ends
                    free_memory=free_memory,
                )
                lease.renewals += 1
            except Exception as exc:
                lease.renew_failures.append(str(exc))
                log.warning("lease renewal failed", lease_id=lease.lease_id, error=str(exc))

    renewer = asyncio.create_task(keep_renewing())
    try:
        yield lease
    finally:
        await cancel_and_wait(renewer)
        try:
            await resume_replicas(
                nc, project, model, lease.lease_id, requested_by=requested_by, timeout_s=min(timeout_s, 10.0)
            )
        except Exception as exc:  # never mask the body's exception; the lease ends the pause
            log.warning("resume failed; replicas resume when the lease ends", error=repr(exc))
