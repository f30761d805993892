"""NATS connection, JetStream provisioning and event publishing.

``publish_event`` is the only way events leave a process: it sets ``Nats-Msg-Id`` to the event's
key, ``<project>.<model>.<id>`` (JetStream drops a re-publish within the duplicate window; ids are
unique only within a tenant), the content type, the schema version and the W3C trace context of
the current span.

Except on the subjects agents publish (``AGENT_SUBJECTS``): there no ``Nats-Msg-Id`` is sent.
JetStream's de-duplication window is one per stream, shared by every tenant, and the server does
not check an id against the publisher: any agent could publish another tenant's next id first
and have that tenant's real message dropped as a duplicate, and a new body under an id already
sent would be dropped silently instead of reaching the collector as a conflict. A message
without an id is never dropped, whatever anyone else sends; de-duplication of agents' events is
their consumers', keyed on (project, model, id) in PostgreSQL, the project being the subject's
(which permissions scope), so a retried publish stored twice in the stream is stored once there,
and a changed body under a stored id is a ``conflict`` dead letter whatever the timing.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import nats
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.api import (
    KeyValueConfig,
    ObjectStoreConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import BadRequestError, NoStreamResponseError, NotFoundError

from artery.schemas import SCHEMA_VERSION, Event
from artery.shared import subjects
from artery.shared.auth import nats_connect_options
from artery.shared.codec import CONTENT_TYPE, EVENT_HEADER, JSON, MSG_ID, SCHEMA_HEADER, encode
from artery.shared.kv import kv_stream
from artery.shared.logs import get_logger
from artery.shared.settings import CommonSettings
from artery.shared.tracing import inject

log = get_logger(__name__)


#: JetStream de-duplicates re-publishes of the same ``Nats-Msg-Id`` within this window.
DUPLICATE_WINDOW_S = 120.0
#: The window of streams agents write to (``StreamSpec.agent_written``): JetStream's minimum.
AGENT_DUPLICATE_WINDOW_S = 0.1


#: What agents publish: their events carry no ``Nats-Msg-Id`` (see the module's docstring).
AGENT_SUBJECTS = (subjects.trajectories("*", "*"), subjects.train("requested", "*", "*"))


def agent_published(subject: str) -> bool:
    return any(subjects.covers(pattern, subject) for pattern in AGENT_SUBJECTS)


def duplicate_window_s(spec: subjects.StreamSpec) -> float:
    return AGENT_DUPLICATE_WINDOW_S if spec.agent_written else DUPLICATE_WINDOW_S


def derived_id(namespace: uuid.UUID, project: str, model: str, cause: str) -> str:
    """The id of an event another one causes (``cause``: that one's id, with a kind where one
    cause has several): the same on every redelivery, so JetStream drops a repeat, and scoped to
    the tenant, since agents choose the ids causes have."""
    return str(uuid.uuid5(namespace, f"{project}/{model}/{cause}"))


def tenant_msg_id(event: Event) -> str:
    """The event's ``Nats-Msg-Id``: its id within its tenant. Names are escaped tokens
    (``subjects.token``), so project ``a.b``, model ``c`` is never project ``a``, model ``b.c``."""
    return f"{subjects.model_key(event.project, event.model)}.{event.id}"


REPLICA_TTL_S = 30.0
#: How long a judge's verdict is kept in its bucket: far longer than any PostgreSQL outage or
#: redelivery, after which the row in PostgreSQL is the record.
VERDICT_TTL_S = 7 * 24 * 3600.0
#: How long a trainer worker's hold on a model lasts unless renewed: a worker renews it while it
#: trains, so this is how long a worker that died keeps others from resuming its models.
TRAINER_LEASE_TTL_S = 30.0


async def connect(settings: CommonSettings, name: str, **options) -> nats.NATS:
    """Connect and keep reconnecting forever: a broker restart must never stop a service."""

    client: list[nats.NATS] = []

    async def on_disconnect():
        if client and client[0].is_closed:  # our own close(), not an outage
            return
        log.warning("nats disconnected", client=name)

    async def on_reconnect():
        log.info("nats reconnected", client=name)

    async def on_error(exc):
        log.warning("nats error", client=name, error=str(exc))

    # Credentials and TLS from ARTERY_NATS_* (see ``auth``); what the caller passes wins.
    options = {
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": 0.5,
        **nats_connect_options(settings),
        **options,
    }
    nc = await nats.connect(
        servers=[u.strip() for u in settings.nats_url.split(",") if u.strip()],
        name=name,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
        error_cb=on_error,
        **options,
    )
    client.append(nc)
    return nc


def stream_config(spec: subjects.StreamSpec, settings: CommonSettings) -> StreamConfig:
    return StreamConfig(
        name=spec.name,
        description=spec.description,
        subjects=list(spec.subjects),
        retention=RetentionPolicy.LIMITS,  # kept for replay; consumers track their own position
        storage=StorageType.FILE,
        num_replicas=settings.stream_replicas,
        allow_direct=spec.direct,
        duplicate_window=duplicate_window_s(spec),
        max_msg_size=settings.max_payload_bytes,
        # A Nats-Rollup header would purge a subject or the whole stream: never honoured on
        # Artery's streams (agents publish into two of them; permissions cannot filter headers).
        allow_rollup_hdrs=False,
    )


async def provision(js: JetStreamContext, settings: CommonSettings) -> None:
    """Create (or bring up to date) every stream, KV bucket and the adapter object store."""
    for spec in subjects.STREAMS:
        config = stream_config(spec, settings)
        try:
            await js.add_stream(config)
        except BadRequestError:  # exists with another config: update what may be updated
            await js.update_stream(config)
    for bucket in kv_buckets(settings):
        await _ensure_kv(js, bucket)
    for store in (subjects.ADAPTERS_BUCKET, subjects.TRAINER_STATE_BUCKET):
        try:
            await js.object_store(store)
        except (NotFoundError, Exception):
            await js.create_object_store(
                store, ObjectStoreConfig(storage=StorageType.FILE, replicas=settings.stream_replicas)
            )


def kv_buckets(settings: CommonSettings) -> list[KeyValueConfig]:
    """Every KV bucket. Direct gets name the key in the subject, so reads of the models and
    verdicts buckets can be granted per key prefix (``shared.permissions``)."""
    replicas = settings.stream_replicas
    return [
        KeyValueConfig(bucket=subjects.MODELS_BUCKET, history=5, replicas=replicas, direct=True),
        KeyValueConfig(bucket=subjects.REPLICAS_BUCKET, history=1, ttl=REPLICA_TTL_S, replicas=replicas),
        KeyValueConfig(
            bucket=subjects.VERDICTS_BUCKET, history=1, ttl=VERDICT_TTL_S, replicas=replicas, direct=True
        ),
        KeyValueConfig(
            bucket=subjects.TRAINER_LEASES_BUCKET,
            history=1,
            ttl=TRAINER_LEASE_TTL_S,
            replicas=replicas,
            direct=True,
        ),
    ]


async def _ensure_kv(js: JetStreamContext, config: KeyValueConfig) -> None:
    try:
        await js.key_value(config.bucket)
    except Exception:
        await js.create_key_value(config)
        return
    if config.direct:  # a bucket made before reads went through direct gets
        stream = (await js.stream_info(kv_stream(config.bucket))).config
        if not stream.allow_direct:
            stream.allow_direct = True
            await js.update_stream(stream)


def event_headers(event: Event, content_type: str = JSON, msg_id: str | None = None) -> dict[str, str]:
    headers = {
        MSG_ID: msg_id or tenant_msg_id(event),
        CONTENT_TYPE: content_type,
        SCHEMA_HEADER: SCHEMA_VERSION,
        EVENT_HEADER: str(type(event).__struct_config__.tag),  # every event's tag is a string
    }
    return inject(headers)


async def publish_event(
    js: JetStreamContext,
    subject: str,
    event: Event,
    *,
    content_type: str = JSON,
    msg_id: str | None = None,
    timeout: float = 10.0,
    headers: dict[str, str] | None = None,
):
    """Publish and wait for the stream's ack (the event is durable when this returns).

    ``headers`` are added to the standard ones (``tracing.link_headers``, for example)."""
    return await js.publish(
        subject,
        encode(event, content_type),
        headers={**(headers or {}), **_headers_for(subject, event, content_type, msg_id)},
        timeout=timeout,
    )


@dataclass(frozen=True)
class Outgoing:
    """An encoded event with its headers, built where its trace context is current."""

    subject: str
    payload: bytes
    headers: dict[str, str]


def _headers_for(subject: str, event: Event, content_type: str, msg_id: str | None) -> dict[str, str]:
    headers = event_headers(event, content_type, msg_id)
    if msg_id is None and agent_published(subject):
        del headers[MSG_ID]  # de-duplicated by its consumer, per tenant (module docstring)
    return headers


def prepare(subject: str, event: Event, *, content_type: str = JSON) -> Outgoing:
    return Outgoing(subject, encode(event, content_type), _headers_for(subject, event, content_type, None))


#: Longest wait for a pipelined publish's ack. ``publish_async`` futures have no timeout of their
#: own: an ack lost with a broker node would otherwise be awaited forever.
ACK_TIMEOUT_S = 10.0


async def _acks(futures: list[asyncio.Future], timeout_s: float) -> list[Any]:
    """Each future's ack or exception; ``TimeoutError`` for those unanswered after ``timeout_s``."""
    if futures:
        _, pending = await asyncio.wait(futures, timeout=timeout_s)
        for future in pending:
            future.cancel()
    results: list[Any] = []
    for future in futures:
        if future.cancelled():
            results.append(TimeoutError(f"no ack within {timeout_s}s"))
        elif future.exception() is not None:
            results.append(future.exception())
        else:
            results.append(future.result())
    return results


async def publish_prepared(
    js: JetStreamContext, messages: Iterable[Outgoing], *, ack_timeout_s: float = ACK_TIMEOUT_S
) -> list:
    """Publish many messages pipelined (``publish_async``), then wait for every ack; raise the
    first error (``TimeoutError`` for an ack that never came)."""
    futures = [await js.publish_async(m.subject, m.payload, headers=m.headers) for m in messages]
    results = await _acks(futures, ack_timeout_s)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


#: A publish whose ack did not come: the stream may or may not have stored it.
_RETRIABLE_PUBLISH_ERRORS = (NatsTimeoutError, NoRespondersError, NoStreamResponseError, TimeoutError)


async def publish_until_acked(
    js: JetStreamContext,
    messages: Iterable[Outgoing],
    *,
    attempts: int = 8,
    delay_s: float = 0.25,
    max_delay_s: float = 4.0,
    ack_timeout_s: float = ACK_TIMEOUT_S,
) -> list:
    """Publish pipelined, then publish again, unchanged, each message whose ack did not come.

    A lost ack (a broker node dies, a stream leader is being elected) does not say whether the
    stream stored the message. Sending the same bytes with the same ``Nats-Msg-Id`` again is safe
    either way: JetStream drops the repeat within its duplicate window, and every row an event
    causes is keyed on its id. Raises the last error when a message is still unacked after
    ``attempts`` rounds (about 20 s with the defaults)."""
    pending = list(messages)
    acks: dict[int, Any] = {}
    indices = list(range(len(pending)))
    for attempt in range(1, attempts + 1):
        futures = [await js.publish_async(m.subject, m.payload, headers=m.headers) for m in pending]
        results = await _acks(futures, ack_timeout_s)
        failed = []
        last_error: BaseException | None = None
        for index, message, result in zip(indices, pending, results, strict=True):
            if isinstance(result, BaseException):
                if not isinstance(result, _RETRIABLE_PUBLISH_ERRORS):
                    raise result
                failed.append((index, message))
                last_error = result
            else:
                acks[index] = result
        if not failed:
            return [acks[i] for i in range(len(acks))]
        if attempt == attempts:
            assert last_error is not None
            raise last_error
        log.warning("publish not acked; sending again", messages=len(failed), attempt=attempt)
        await asyncio.sleep(min(delay_s * 2 ** (attempt - 1), max_delay_s))
        indices = [i for i, _ in failed]
        pending = [m for _, m in failed]
    raise AssertionError("unreachable")


async def publish_events(
    js: JetStreamContext, items: Iterable[tuple[str, Event]], *, content_type: str = JSON
) -> list:
    return await publish_prepared(
        js, [prepare(subject, event, content_type=content_type) for subject, event in items]
    )


async def close(nc: nats.NATS) -> None:
    """Flush what is buffered (acks, publishes), then close.

    Not ``drain()``: nats-py's drain waits on pull subscriptions that never finish draining.
    """
    if nc.is_closed:
        return
    try:
        await nc.flush(timeout=2)
    except Exception as exc:  # best effort: a broker that is gone cannot be flushed to
        log.warning("flush before close failed", error=repr(exc))
    await nc.close()
