"""NATS connection, JetStream provisioning and event publishing.

``publish_event`` is the only way events leave a process: it sets ``Nats-Msg-Id`` to the event
id (JetStream drops a re-publish within the duplicate window), the content type, the schema
version and the W3C trace context of the current span.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass

import nats
from nats.js import JetStreamContext
from nats.js.api import (
    KeyValueConfig,
    ObjectStoreConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import BadRequestError, NotFoundError

from artery.schemas import SCHEMA_VERSION, Event
from artery.shared import subjects
from artery.shared.codec import JSON, encode
from artery.shared.logs import get_logger
from artery.shared.settings import CommonSettings
from artery.shared.tracing import inject

log = get_logger(__name__)

MSG_ID = "Nats-Msg-Id"
CONTENT_TYPE = "Content-Type"
SCHEMA_HEADER = "Artery-Schema"
EVENT_HEADER = "Artery-Event"

#: JetStream de-duplicates re-publishes of the same ``Nats-Msg-Id`` within this window.
DUPLICATE_WINDOW_S = 120.0
REPLICA_TTL_S = 30.0


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

    options = {"max_reconnect_attempts": -1, "reconnect_time_wait": 0.5, **options}
    nc = await nats.connect(
        servers=[u.strip() for u in settings.nats_url.split(",") if u.strip()],
        name=name,
        user_credentials=settings.nats_creds,
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
        duplicate_window=DUPLICATE_WINDOW_S,
        max_msg_size=settings.max_payload_bytes,
    )


async def provision(js: JetStreamContext, settings: CommonSettings) -> None:
    """Create (or bring up to date) every stream, KV bucket and the adapter object store."""
    for spec in subjects.STREAMS:
        config = stream_config(spec, settings)
        try:
            await js.add_stream(config)
        except BadRequestError:  # exists with another config: update what may be updated
            await js.update_stream(config)
    await _ensure_kv(
        js,
        KeyValueConfig(bucket=subjects.MODELS_BUCKET, history=5, replicas=settings.stream_replicas),
    )
    await _ensure_kv(
        js,
        KeyValueConfig(
            bucket=subjects.REPLICAS_BUCKET,
            history=1,
            ttl=REPLICA_TTL_S,
            replicas=settings.stream_replicas,
        ),
    )
    try:
        await js.object_store(subjects.ADAPTERS_BUCKET)
    except (NotFoundError, Exception):
        await js.create_object_store(
            subjects.ADAPTERS_BUCKET,
            ObjectStoreConfig(storage=StorageType.FILE, replicas=settings.stream_replicas),
        )


async def _ensure_kv(js: JetStreamContext, config: KeyValueConfig) -> None:
    try:
        await js.key_value(config.bucket)
    except Exception:
        await js.create_key_value(config)


def event_headers(event: Event, content_type: str = JSON, msg_id: str | None = None) -> dict[str, str]:
    headers = {
        MSG_ID: msg_id or event.id,
        CONTENT_TYPE: content_type,
        SCHEMA_HEADER: SCHEMA_VERSION,
        EVENT_HEADER: type(event).__struct_config__.tag,
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
):
    """Publish and wait for the stream's ack (the event is durable when this returns)."""
    return await js.publish(
        subject,
        encode(event, content_type),
        headers=event_headers(event, content_type, msg_id),
        timeout=timeout,
    )


@dataclass(frozen=True)
class Outgoing:
    """An encoded event with its headers, built where its trace context is current."""

    subject: str
    payload: bytes
    headers: dict[str, str]


def prepare(subject: str, event: Event, *, content_type: str = JSON) -> Outgoing:
    return Outgoing(subject, encode(event, content_type), event_headers(event, content_type))


async def publish_prepared(js: JetStreamContext, messages: Iterable[Outgoing]) -> list:
    """Publish many messages pipelined (``publish_async``), then wait for every ack."""
    futures = [await js.publish_async(m.subject, m.payload, headers=m.headers) for m in messages]
    return list(await asyncio.gather(*futures))


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
