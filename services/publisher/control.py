"""Retention on demand: ``RetentionRequested`` in (NATS request/reply), ``RetentionApplied`` out.

This is what the SDK's ``model.delete_checkpoints()`` sends. Publisher replicas subscribe in one
queue group, so each request is answered once. Retention itself is the same code the consumer
runs after each publish (``Publisher.apply_retention``), serialised per model by an advisory
lock, so a request racing a publish cannot delete the step being published.

Bad input never takes the service down: it is answered with ``error`` set (so the caller fails
at once instead of timing out) and recorded as a ``DeadLetter`` on ``artery.dlq.publisher``. An
outage (PostgreSQL, the Object Store) is answered with ``error`` too, and not dead-lettered: the
caller may simply ask again.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import re
import uuid

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from artery.schemas import RetentionApplied, RetentionRequested
from artery.schemas.base import NAME_PATTERN
from artery.schemas.deadletter import UNKNOWN
from artery.services.publisher import store
from artery.services.publisher.retention import RetentionPolicy
from artery.services.publisher.service import SERVICE, Publisher
from artery.shared import subjects
from artery.shared.bus import CONTENT_TYPE, event_headers, publish_event
from artery.shared.codec import EventDecoder, encode
from artery.shared.consumer import dead_letter_event
from artery.shared.errors import DependencyUnavailable, InvalidMessage
from artery.shared.logs import get_logger
from artery.shared.registry import models_kv, read_record
from artery.shared.wakeup import woken_by

log = get_logger(__name__)

_APPLIED_NAMESPACE = uuid.UUID("3e0b9d27-1f4c-4a8e-b6d2-72657461696e")
_DLQ_NAMESPACE = uuid.UUID("3e0b9d27-1f4c-4a8e-b6d2-646c71726574")
_DLQ_PAYLOAD_BYTES = 16 * 1024
_NAME = re.compile(NAME_PATTERN)
_decoder = EventDecoder(RetentionRequested)
#: How long a retention request waits for the step the registry names to be recorded (the SDK
#: asks with a 30 s timeout).
CATCH_UP_S = 10.0
#: The wait looks again this often in case a ``checkpoint.published`` was missed (a reconnect).
RECHECK_S = 2.0


class RetentionServer:
    def __init__(self, nc: NATS, publisher: Publisher):
        self.nc = nc
        self.publisher = publisher
        self._sub: Subscription | None = None

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(
            subjects.retention_request("*", "*"), queue=SERVICE, cb=self._on_request
        )
        await self.nc.flush()  # subscribed at the server before anyone is told we are ready

    async def stop(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None

    async def _on_request(self, msg: Msg) -> None:
        digest = hashlib.sha256(msg.subject.encode() + b"\0" + msg.data).hexdigest()
        project, model = _names(msg.subject)
        reply = RetentionApplied(id=str(uuid.uuid5(_APPLIED_NAMESPACE, digest)), project=project, model=model)
        try:
            request = _decoder.decode(msg.data, (msg.headers or {}).get(CONTENT_TYPE))
            if msg.subject != subjects.retention_request(request.project, request.model):
                raise InvalidMessage(
                    "subject_mismatch", f"{request.project}/{request.model} requested on {msg.subject}"
                )
            policy = RetentionPolicy(
                keep_latest=request.keep_latest,
                best_metric=request.best_metric,
                best_mode=request.best_mode,
                keep_steps=tuple(request.keep_steps),
            )
            await self._caught_up(request.project, request.model)
            plan = await self.publisher.apply_retention(
                request.project, request.model, policy, reason="requested"
            )
            reply = RetentionApplied(
                id=str(uuid.uuid5(_APPLIED_NAMESPACE, request.id)),
                project=request.project,
                model=request.model,
                step=plan.keep[-1] if plan.keep else None,
                kept=list(plan.keep),
                deleted=list(plan.delete),
                best_step=plan.best,
            )
        except InvalidMessage as exc:
            await self._dead_letter(msg, exc, digest, project, model)
            reply.error = f"{exc.kind}: {exc.reason}"
        except DependencyUnavailable as exc:
            log.warning("retention request failed; dependency unavailable", error=str(exc))
            reply.error = f"unavailable: {exc}"
        except Exception as exc:  # a bug: answer, never take the service down
            log.exception("retention request failed")
            reply.error = f"internal: {exc!r}"
        if msg.reply:
            try:
                await self.nc.publish(msg.reply, encode(reply), headers=event_headers(reply))
            except Exception as exc:  # the caller times out; nothing more to do
                log.warning("retention reply failed", error=repr(exc))

    async def _caught_up(self, project: str, model: str) -> None:
        """Wait until the newest step recorded here is the registry's, for at most ``CATCH_UP_S``.

        ``train()`` returns once its step is served, and replicas may load a step from the
        trainer's store before any publisher has recorded it; the trainer moves the registry to
        that step first. A ``delete_checkpoints()`` right after ``train()`` must see that step (keep
        it as the latest, weigh its metrics), so the request waits for it, woken by this service's
        own ``checkpoint.published``. A step that never comes (dead-lettered) only delays the
        answer: retention then applies to what is recorded."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CATCH_UP_S
        published = subjects.checkpoint("published", project, model)
        async with woken_by(self.nc, published, waiter="publisher_retention") as wake:
            while True:
                wake.clear()
                found = await read_record(models_kv(self.publisher.js), project, model)
                wanted = found.record.step if found is not None else 0
                async with self.publisher.db.connection() as conn:
                    recorded = await store.newest_step(conn, project, model)
                if recorded >= wanted:
                    wake.satisfied()
                    return
                left = deadline - loop.time()
                if left <= 0:
                    log.warning(
                        "retention applied before the registry's step was recorded",
                        project=project,
                        model=model,
                        registry_step=wanted,
                        recorded_step=recorded,
                    )
                    return
                await wake.wait(min(left, RECHECK_S))

    async def _dead_letter(
        self, msg: Msg, error: InvalidMessage, digest: str, project: str, model: str
    ) -> None:
        letter = dead_letter_event(
            msg,
            error,
            letter_id=str(uuid.uuid5(_DLQ_NAMESPACE, digest)),
            service=SERVICE,
            project=project,
            model=model,
            payload_limit=_DLQ_PAYLOAD_BYTES,
        )
        log.warning("retention request rejected", kind=error.kind, reason=error.reason[:300])
        try:
            await publish_event(self.publisher.js, subjects.dead_letter(SERVICE), letter)
        except Exception as exc:
            log.warning("dead letter publish failed", error=repr(exc))


def _names(subject: str) -> tuple[str, str]:
    """(project, model) from a retention subject, or UNKNOWN where a token is not a valid name."""
    pattern = subjects.retention_request("*", "*").split(".")
    parts = subject.split(".")
    if len(parts) != len(pattern):
        return UNKNOWN, UNKNOWN
    project, model = (subjects.name_of(parts[i]) for i, token in enumerate(pattern) if token == "*")
    return (project if _NAME.match(project) else UNKNOWN, model if _NAME.match(model) else UNKNOWN)
