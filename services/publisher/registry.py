"""The model registry's writer: ``register()`` and replica listings, answered for agents.

Agents may not publish on ``$KV.`` subjects (a KV stream honours ``Nats-Rollup``: one publish
could purge every tenant's records) nor create consumers. They ask here instead, on
``<prefix>.control.publisher.<project>.<model>.register|replicas``; their NATS user may publish
on its own project's subjects only, so the project in the subject is the caller's.

The publisher answers because it is the control plane's owner of a model's state beyond one
step: it stores and retires the project's adapters (the ones a warm start may come from), it
already answers agents' retention requests the same way, and it is not on the trajectories' hot
path, so a registration never waits behind a batch of groups at the collector.

A registration is checked before anything is stored: the record must name the subject's model,
its base model must be one the operator allows (``base_models``), and the usual registry rule
applies (``registry.registered``). It is written with compare-and-set, so the trainer advancing
the step meanwhile is never undone. Bad input is answered with ``error`` at once.
"""

from __future__ import annotations

import contextlib
import re
import uuid

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from artery.schemas import ModelRecord, ModelRegistered, ModelRegistrationRequested, ReplicasListed
from artery.schemas.base import NAME_PATTERN
from artery.schemas.deadletter import UNKNOWN
from artery.services.publisher.base_models import BaseModelPolicy
from artery.services.publisher.service import SERVICE
from artery.shared import subjects
from artery.shared.bus import CONTENT_TYPE, event_headers
from artery.shared.codec import EventDecoder, encode
from artery.shared.control_client import live_replicas
from artery.shared.errors import InvalidMessage
from artery.shared.logs import get_logger
from artery.shared.registry import decode_record, registered

log = get_logger(__name__)
_NAME = re.compile(NAME_PATTERN)
#: A record is a few hundred bytes; anything far larger is not one.
MAX_REQUEST_BYTES = 64 * 1024
#: Compare-and-set attempts when the trainer moves the step between our read and our write.
_CAS_ATTEMPTS = 5
_decoder = EventDecoder(ModelRegistrationRequested)
_ANSWER_NAMESPACE = uuid.UUID("5d1c7a0e-2b4f-4e8a-9c3d-726567697374")


class RegistryServer:
    def __init__(self, nc: NATS, policy: BaseModelPolicy):
        self.nc = nc
        self.js = nc.jetstream()
        self.policy = policy
        self._subs: list[Subscription] = []

    async def start(self) -> None:
        self._subs = [
            await self.nc.subscribe(subjects.register_request("*", "*"), queue=SERVICE, cb=self._on_register),
            await self.nc.subscribe(subjects.replicas_request("*", "*"), queue=SERVICE, cb=self._on_replicas),
        ]
        await self.nc.flush()  # subscribed at the server before anyone is told we are ready

    async def stop(self) -> None:
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._subs = []

    async def _on_register(self, msg: Msg) -> None:
        project, model = _names_or_unknown(msg.subject, subjects.register_request("*", "*"))
        reply = ModelRegistered(id=_answer_id(msg), project=project, model=model)
        try:
            project, model = _names(msg.subject, subjects.register_request("*", "*"))
            reply.record = await self.register(
                project, model, msg.data, (msg.headers or {}).get(CONTENT_TYPE)
            )
        except InvalidMessage as exc:
            log.warning("registration refused", subject=msg.subject, kind=exc.kind, reason=exc.reason[:300])
            reply.error = f"{exc.kind}: {exc.reason}"
        except Exception as exc:  # an outage or a bug: answer, never take the service down
            log.exception("registration failed")
            reply.error = f"unavailable: {exc!r}"
        await _answer(self.nc, msg, reply)

    async def register(
        self, project: str, model: str, data: bytes, content_type: str | None = None
    ) -> ModelRecord:
        if len(data) > MAX_REQUEST_BYTES:
            raise InvalidMessage("too_large", f"{len(data)} bytes is more than {MAX_REQUEST_BYTES}")
        request = _decoder.decode(data, content_type)
        requested = request.record
        if {(request.project, request.model), (requested.project, requested.name)} != {(project, model)}:
            raise InvalidMessage(
                "subject_mismatch", f"{requested.project}/{requested.name} registered as {project}/{model}"
            )
        base_model = self.policy.check(project, requested.base_model)
        requested = msgspec.structs.replace(requested, base_model=base_model)
        kv = await self.js.key_value(subjects.MODELS_BUCKET)
        key = subjects.model_key(project, model)
        for _ in range(_CAS_ATTEMPTS):
            try:
                entry = await kv.get(key)
            except KeyNotFoundError:
                entry = None
            found = decode_record(project, model, entry.value or b"") if entry is not None else None
            try:
                record = registered(requested, found)
            except ValueError as exc:
                raise InvalidMessage("lora_changed", str(exc)) from None
            value = msgspec.json.encode(record)
            try:
                if entry is None:
                    await kv.create(key, value)
                else:
                    await kv.update(key, value, last=entry.revision)
            except KeyWrongLastSequenceError:
                continue  # the trainer (or another registration) wrote first: read again
            return record
        raise RuntimeError(f"{key} kept changing while it was registered")

    async def _on_replicas(self, msg: Msg) -> None:
        project, model = _names_or_unknown(msg.subject, subjects.replicas_request("*", "*"))
        reply = ReplicasListed(id=_answer_id(msg), project=project, model=model)
        try:
            project, model = _names(msg.subject, subjects.replicas_request("*", "*"))
            reply.replicas = await live_replicas(self.js, project, model)
        except InvalidMessage as exc:
            reply.error = f"{exc.kind}: {exc.reason}"
        except Exception as exc:
            log.warning("listing replicas failed", subject=msg.subject, error=repr(exc))
            reply.error = f"unavailable: {exc!r}"
        await _answer(self.nc, msg, reply)


def _answer_id(msg: Msg) -> str:
    """The same answer id for the same request (a retried request is answered alike)."""
    return str(uuid.uuid5(_ANSWER_NAMESPACE, msg.subject + "\0" + msg.data.decode(errors="replace")))


async def _answer(nc: NATS, msg: Msg, reply) -> None:
    if not msg.reply:
        return
    try:
        await nc.publish(msg.reply, encode(reply), headers=event_headers(reply))
    except Exception as exc:  # the caller times out; nothing more to do
        log.warning("registry reply failed", error=repr(exc))


def _names(subject: str, pattern: str) -> tuple[str, str]:
    """(project, model) of a request subject matching ``pattern``'s two ``*`` tokens."""
    want, parts = pattern.split("."), subject.split(".")
    if len(parts) != len(want):
        raise InvalidMessage("subject", f"not a registry subject: {subject!r}")
    project, model = (subjects.name_of(parts[i]) for i, token in enumerate(want) if token == "*")
    if not (_NAME.match(project) and _NAME.match(model)):
        raise InvalidMessage("subject", f"{subject!r} names no valid project and model")
    return project, model


def _names_or_unknown(subject: str, pattern: str) -> tuple[str, str]:
    """(project, model) for the answer's envelope; ``UNKNOWN`` where the subject names none."""
    try:
        return _names(subject, pattern)
    except InvalidMessage:
        return UNKNOWN, UNKNOWN
