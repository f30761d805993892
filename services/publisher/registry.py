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

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from artery.schemas import ModelRecord
from artery.schemas.base import NAME_PATTERN
from artery.services.publisher.base_models import BaseModelPolicy
from artery.services.publisher.service import SERVICE
from artery.shared import subjects
from artery.shared.control_client import live_replicas
from artery.shared.errors import InvalidMessage
from artery.shared.logs import get_logger
from artery.shared.registry import RegistrationReply, ReplicasReply, decode_record, registered

log = get_logger(__name__)
_NAME = re.compile(NAME_PATTERN)
#: A record is a few hundred bytes; anything far larger is not one.
MAX_REQUEST_BYTES = 64 * 1024
#: Compare-and-set attempts when the trainer moves the step between our read and our write.
_CAS_ATTEMPTS = 5
_record_decoder = msgspec.json.Decoder(ModelRecord)


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
        reply = RegistrationReply()
        try:
            project, model = _names(msg.subject, subjects.register_request("*", "*"))
            reply.record = await self.register(project, model, msg.data)
        except InvalidMessage as exc:
            log.warning("registration refused", subject=msg.subject, kind=exc.kind, reason=exc.reason[:300])
            reply.error = f"{exc.kind}: {exc.reason}"
        except Exception as exc:  # an outage or a bug: answer, never take the service down
            log.exception("registration failed")
            reply.error = f"unavailable: {exc!r}"
        await _answer(self.nc, msg, reply)

    async def register(self, project: str, model: str, data: bytes) -> ModelRecord:
        if len(data) > MAX_REQUEST_BYTES:
            raise InvalidMessage("too_large", f"{len(data)} bytes is more than {MAX_REQUEST_BYTES}")
        try:
            requested = _record_decoder.decode(data)
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
            raise InvalidMessage("decode", str(exc)) from None
        if (requested.project, requested.name) != (project, model):
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
        reply = ReplicasReply()
        try:
            project, model = _names(msg.subject, subjects.replicas_request("*", "*"))
            reply.replicas = await live_replicas(self.js, project, model)
        except InvalidMessage as exc:
            reply.error = f"{exc.kind}: {exc.reason}"
        except Exception as exc:
            log.warning("listing replicas failed", subject=msg.subject, error=repr(exc))
            reply.error = f"unavailable: {exc!r}"
        await _answer(self.nc, msg, reply)


async def _answer(nc: NATS, msg: Msg, reply: msgspec.Struct) -> None:
    if not msg.reply:
        return
    try:
        await nc.publish(msg.reply, msgspec.json.encode(reply))
    except Exception as exc:  # the caller times out; nothing more to do
        log.warning("registry reply failed", error=repr(exc))


def _names(subject: str, pattern: str) -> tuple[str, str]:
    """(project, model) of a request subject matching ``pattern``'s two ``*`` tokens."""
    want, parts = pattern.split("."), subject.split(".")
    if len(parts) != len(want):
        raise InvalidMessage("subject", f"not a registry subject: {subject!r}")
    project, model = (parts[i] for i, token in enumerate(want) if token == "*")
    if not (_NAME.match(project) and _NAME.match(model)):
        raise InvalidMessage("subject", f"{subject!r} names no valid project and model")
    return project, model
