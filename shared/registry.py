"""The model registry (KV ``artery_models``, key ``<project>.<model>``): registering, and reading
it without trusting it.

Records are written by the control plane only: an agent's ``register()`` is a request on
``subjects.register_request`` that the publisher answers (``services.publisher.registry``), after
checking the base model against the operator's allow-list. Agents may not publish on ``$KV.``
subjects at all: a KV bucket's stream honours ``Nats-Rollup`` headers, so one publish there
could purge every tenant's records. ``registered`` is the one rule for what a registration
stores (its step kept, its LoRA shape fixed once trained), used by the responder and, on a bus
with no responder and no authentication (a bare ``nats-server`` in a test), by the SDK itself.

Every reader goes through ``read_record``: a record that does not decode, or that names another
model than its key, counts as absent, with a warning naming the key; it never crashes a reader
or fails a request again and again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import msgspec
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

from artery.schemas import (
    ModelRecord,
    ModelRegistered,
    ModelRegistrationRequested,
    ReplicaInfo,
    ReplicasListed,
    ReplicasRequested,
    new_event_id,
    utcnow,
)
from artery.shared import subjects
from artery.shared.bus import event_headers
from artery.shared.codec import EventDecoder, encode
from artery.shared.kv import kv_stream
from artery.shared.logs import get_logger

log = get_logger(__name__)
_decoder = msgspec.json.Decoder(ModelRecord)
_replica_info = msgspec.json.Decoder(ReplicaInfo)


class RegistryEntry(msgspec.Struct, frozen=True):
    record: ModelRecord
    revision: int


def decode_record(project: str, model: str, value: bytes) -> ModelRecord | None:
    """The record stored under ``<project>.<model>``, or None (and a warning) when it is garbage."""
    key = subjects.model_key(project, model)
    try:
        record = _decoder.decode(value)
    except msgspec.DecodeError as exc:  # ValidationError included
        log.warning("invalid model record ignored", key=key, error=str(exc))
        return None
    if (record.project, record.name) != (project, model):
        log.warning(
            "model record ignored: it names another model", key=key, names=f"{record.project}.{record.name}"
        )
        return None
    return record


async def read_record(kv: KeyValue, project: str, model: str) -> RegistryEntry | None:
    """The model's valid record and its revision (for compare-and-set), or None."""
    try:
        entry = await kv.get(subjects.model_key(project, model))
    except KeyNotFoundError:  # never registered, or deleted
        return None
    record = decode_record(project, model, entry.value or b"")
    # nats-py types the revision as optional; an entry read from the bucket always has one.
    return None if record is None or entry.revision is None else RegistryEntry(record, entry.revision)


def models_kv(js: JetStreamContext) -> KeyValue:
    """The models bucket, read by direct gets, opened without ``STREAM.INFO``: agents may not ask
    for a stream's info, whose ``subjects_filter`` would list every tenant's keys."""
    bucket = subjects.MODELS_BUCKET
    return KeyValue(name=bucket, stream=kv_stream(bucket), pre=f"$KV.{bucket}.", js=js, direct=True)


def registered(requested: ModelRecord, found: ModelRecord | None) -> ModelRecord:
    """What registering ``requested`` stores over ``found``: the current step is kept, and so is
    the LoRA shape when none is asked for; a new shape once trained is a ``ValueError``."""
    step = found.step if found else 0
    lora = requested.lora
    if found is not None and lora is None:
        lora = found.lora  # re-registered without one: keep the shape it trained with
    elif found is not None and step > 0 and lora != found.lora:
        raise ValueError(
            f"{requested.project}/{requested.name} has trained {step} steps with LoRA"
            f" {msgspec.to_builtins(found.lora) or 'defaults'}; its shape cannot change to"
            f" {msgspec.to_builtins(lora)}: register the new config under a new model name"
        )
    return msgspec.structs.replace(requested, step=step, lora=lora, registered_at=utcnow())


_registered_decoder = EventDecoder(ModelRegistered)
_replicas_decoder = EventDecoder(ReplicasListed)


class RegistrationRefused(ValueError):
    """The registry refused the record (its reason is the message)."""


async def register(js: JetStreamContext, requested: ModelRecord, *, timeout_s: float = 30.0) -> ModelRecord:
    """Register ``requested`` through the control plane; the stored record.

    On a bus where nobody answers (no publisher is running) the record is written here instead,
    by the same rule: that is only possible where the bus lets this client write the bucket, a
    bare ``nats-server`` without authentication; an agent's user on a secure stack may not."""
    from nats.errors import NoRespondersError

    nc = js._nc  # the request goes out on the context's own connection
    subject = subjects.register_request(requested.project, requested.name)
    request = ModelRegistrationRequested(
        id=new_event_id(), project=requested.project, model=requested.name, record=requested
    )
    try:
        reply = await nc.request(subject, encode(request), timeout=timeout_s, headers=event_headers(request))
    except NoRespondersError:
        return await _register_here(js, requested)
    answer = _registered_decoder.decode(reply.data)
    if answer.error is not None or answer.record is None:
        raise RegistrationRefused(answer.error or "the registry answered without a record")
    return answer.record


async def _register_here(js: JetStreamContext, requested: ModelRecord) -> ModelRecord:
    log.warning("no registry service answers; writing the model record directly", model=requested.name)
    try:
        kv = await js.key_value(subjects.MODELS_BUCKET)
        found = await read_record(kv, requested.project, requested.name)
    except Exception as exc:
        raise RuntimeError(_NO_REGISTRY.format(model=requested.name, error=repr(exc))) from exc
    record = registered(requested, found.record if found else None)  # refusals raised as they are
    try:
        await kv.put(subjects.model_key(record.project, record.name), msgspec.json.encode(record))
    except Exception as exc:
        raise RuntimeError(_NO_REGISTRY.format(model=requested.name, error=repr(exc))) from exc
    return record


_NO_REGISTRY = (
    "cannot register {model}: no registry service (the publisher) answers, and this client may not"
    " write the models bucket itself ({error}); start the publisher"
)


#: One ask of the registry service for a replica list: a publisher that died with the request (or
#: is restarting) is asked again within the caller's whole wait, not waited on for all of it.
_REPLICAS_ATTEMPT_S = 2.0


async def project_replicas(js: JetStreamContext, project: str, model: str, *, timeout_s: float = 10.0):
    """The live replicas of ``project``/``model``, read by the control plane on the caller's
    behalf (agents create no consumers). Where nobody answers (no publisher: a bare
    ``nats-server`` in a test), they are read here, which only an unrestricted client may do.

    A publisher that is down or restarting is retried until ``timeout_s``: ``train()`` waits on
    this list, and one publisher restart must not fail a step that trained."""
    from nats.errors import NoRespondersError
    from nats.errors import TimeoutError as NatsTimeout

    from artery.shared.control_client import live_replicas

    request = ReplicasRequested(id=new_event_id(), project=project, model=model)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        attempt_s = max(min(_REPLICAS_ATTEMPT_S, deadline - loop.time()), 0.05)
        try:
            reply = await js._nc.request(
                subjects.replicas_request(project, model),
                encode(request),
                timeout=attempt_s,
                headers=event_headers(request),
            )
        except NoRespondersError as exc:
            try:
                return await live_replicas(js, project, model)
            except Exception:  # a client that may not read the bucket: wait for the publisher
                failure: BaseException = exc
        except NatsTimeout as exc:  # the publisher died holding the request, or is busy
            failure = exc
        else:
            answer = _replicas_decoder.decode(reply.data)
            if answer.error is not None:
                raise RuntimeError(f"listing the replicas of {project}/{model} failed: {answer.error}")
            return answer.replicas
        if loop.time() >= deadline:
            raise TimeoutError(
                f"no registry service (the publisher) listed the replicas of {project}/{model}"
                f" within {timeout_s}s: {failure!r}"
            ) from failure
        await asyncio.sleep(0.1)  # a publisher restarting: its subscription is back within seconds


def served_by_updates(messages: Iterable[Msg]) -> dict[str, list[str]]:
    """What each replica serves by the registry updates heard (deletions left out)."""
    served: dict[str, list[str]] = {}
    for msg in messages:
        if (msg.headers or {}).get("KV-Operation") in ("DEL", "PURGE"):
            continue
        try:
            info = _replica_info.decode(msg.data)
        except msgspec.DecodeError:  # not a heartbeat we can read: the store read decides
            continue
        served[info.replica_id] = list(info.served)
    return served


def served_by_all(name: str, listed: list[ReplicaInfo], heard: Iterable[Msg], *, joined: bool) -> bool:
    """Whether every replica serves ``name``, by the list read or by its newest registry entry
    ``heard`` since. ``joined``: the list may be old, so a replica heard of that it does not name
    (one started since) must serve it too; a list read just now is the whole membership (an entry
    heard of a replica gone since would otherwise hold a wait until its timeout)."""
    updates = served_by_updates(heard)
    served = {r.replica_id: r.served for r in listed}
    if joined:
        served.update({replica: [] for replica in updates.keys() - served.keys()})
    return all(name in names or name in updates.get(replica, ()) for replica, names in served.items())
