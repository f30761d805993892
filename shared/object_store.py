"""Objects in NATS's Object Store, written and read a batch of chunks at a time.

nats-py's ``ObjectStore.put`` waits for each 128 KiB chunk's ack before it sends the next, and its
``get`` reads through an ordered consumer that waits forever when the object is deleted mid-read.
``write_object`` and ``read_object`` keep nats-py's layout exactly (so nats-py, and any other
client, reads what is written here, and the other way round) and move the chunks in pipelined
publishes and batched direct gets: a step's adapter and optimizer state (tens of MB for
SmolLM2) go through in tens of ms, not hundreds (``docs/results/2026-11-29-object-store-transfers.md``).

The adapters bucket (``shared.adapters``) and the trainer-state bucket (``shared.trainer_state``)
both go through here; what an object may hold, and who may read it, they decide.
"""

from __future__ import annotations

import asyncio
import base64
import enum
import hashlib
import io
import json
import weakref
from collections.abc import Callable
from datetime import UTC, datetime

from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.api import Header, ObjectInfo, ObjectMetaOptions
from nats.js.errors import NotFoundError
from nats.js.kv import MSG_ROLLUP_SUBJECT
from nats.js.object_store import (
    OBJ_CHUNKS_PRE_TEMPLATE,
    OBJ_DEFAULT_CHUNK_SIZE,
    OBJ_DIGEST_TEMPLATE,
    OBJ_META_PRE_TEMPLATE,
    OBJ_STREAM_TEMPLATE,
)

from artery.shared.bus import Outgoing, publish_prepared
from artery.shared.errors import ArteryError
from artery.shared.logs import get_logger

log = get_logger(__name__)


class ObjectCorrupt(ArteryError):
    """The chunks read do not match the object's size and digest."""


class ObjectGone(ArteryError):
    """The object was deleted (or replaced) while it was read: its chunks are purged."""


#: Chunks in flight at once while writing (32 MiB): a step's state of GBs is not copied whole
#: into the connection's buffer, and the acks keep coming while the next window is sent.
WRITE_WINDOW = 256


def nats_digest(data: bytes) -> str:
    """The Object Store's spelling of the sha256 of ``data`` (``SHA-256=<base64url>``)."""
    return nats_digest_of_hex(hashlib.sha256(data).hexdigest())


def nats_digest_of_hex(sha256: str) -> str:
    """The same spelling of a sha256 given in hex (an event's ``sha256``), without the bytes."""
    return OBJ_DIGEST_TEMPLATE.format(digest=base64.urlsafe_b64encode(bytes.fromhex(sha256)).decode())


def meta_subject(bucket: str, name: str) -> str:
    """The subject of object ``name``'s metadata in ``bucket`` (its last message there is it)."""
    return OBJ_META_PRE_TEMPLATE.format(bucket=bucket, obj=base64.urlsafe_b64encode(name.encode()).decode())


async def object_info(js: JetStreamContext, bucket: str, name: str) -> ObjectInfo | None:
    """The metadata of ``name`` in ``bucket``, in one message get (nats-py's ``object_store()``
    asks for the stream's info first, a round trip more on the path of every step); None when it
    is not there (never stored, deleted, or no such bucket). ``ObjectCorrupt`` when the metadata
    is not valid; NATS's own errors pass through."""
    try:
        msg = await js.get_last_msg(OBJ_STREAM_TEMPLATE.format(bucket=bucket), meta_subject(bucket, name))
    except NotFoundError:
        return None
    try:
        found = ObjectInfo.from_response(json.loads(msg.data or b""))
    except (ValueError, TypeError, KeyError) as exc:
        raise ObjectCorrupt(f"metadata of {name!r} in {bucket} is not valid") from exc
    return None if found.deleted else found


async def put_object(
    js: JetStreamContext, bucket: str, name: str, data: bytes, *, sha256: str | None = None
) -> ObjectInfo:
    """Store ``data`` as ``name`` unless the same bytes are there already (a redelivered event
    stores its object again, harmlessly); returns what is stored. ``sha256``: the hex digest of
    ``data`` when the caller has it (hashing a step's tens of MB costs ms each time)."""
    digest = nats_digest_of_hex(sha256) if sha256 is not None else nats_digest(data)
    found = await object_info(js, bucket, name)
    if found is not None and found.size == len(data) and found.digest == digest:
        return found
    return await write_object(js, bucket, name, data, previous=found, digest=digest)


class Previous(enum.Enum):
    """``write_object``'s ``previous`` when the caller has not read the object's metadata."""

    UNREAD = "unread"


async def write_object(
    js: JetStreamContext,
    bucket: str,
    name: str,
    data: bytes,
    *,
    previous: ObjectInfo | Previous | None = Previous.UNREAD,
    digest: str | None = None,
) -> ObjectInfo:
    """Store ``data`` as ``name`` in object store ``bucket``, as nats-py's ``ObjectStore.put``
    lays it out (chunks on a new subject, then the metadata rolled up, then the previous
    version's chunks purged), but with the chunks pipelined: ``put`` waits for each chunk's ack
    before it sends the next, one round trip per 128 KiB, which made a step's upload (tens of MB
    for SmolLM2's adapter and optimizer state) a third of the trainer's time outside training.
    The chunks go out in order on one connection, so the stream holds them in order; the
    metadata is published only after every chunk is acked, so a reader never sees an object
    whose chunks are not all stored. A failure purges the chunks sent and raises.

    ``previous``: the object's metadata as the caller just read it (None: not there), whose chunks
    the write purges; unread, it is read here (one round trip fewer when the caller has it).
    ``digest``: ``nats_digest(data)`` when the caller has computed it."""
    if previous is Previous.UNREAD:
        previous = await object_info(js, bucket, name)
    nuid = js._nc._nuid.next().decode()  # nats-py's own id source, as ``put`` uses
    stream = OBJ_STREAM_TEMPLATE.format(bucket=bucket)
    chunk_subject = OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=bucket, obj=nuid)
    starts = range(0, len(data), OBJ_DEFAULT_CHUNK_SIZE)
    info = ObjectInfo(
        name=name,
        bucket=bucket,
        nuid=nuid,
        size=len(data),
        chunks=len(starts),
        digest=digest if digest is not None else nats_digest(data),
        options=ObjectMetaOptions(max_chunk_size=OBJ_DEFAULT_CHUNK_SIZE),
        mtime=datetime.now(UTC).isoformat(),
    )
    meta = json.dumps(info.as_dict()).encode()
    try:
        view = memoryview(data)
        for window in range(0, len(starts), WRITE_WINDOW):  # a window's copies in memory at a time
            await publish_prepared(
                js,
                [
                    Outgoing(chunk_subject, bytes(view[at : at + OBJ_DEFAULT_CHUNK_SIZE]), {})
                    for at in starts[window : window + WRITE_WINDOW]
                ],
            )
        await js.publish(meta_subject(bucket, name), meta, headers={Header.ROLLUP: MSG_ROLLUP_SUBJECT})
    except BaseException:
        await asyncio.shield(_purge_quietly(js, stream, chunk_subject))
        raise
    if previous is not None and not previous.deleted and previous.nuid:
        old_chunks = OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=bucket, obj=previous.nuid)
        await js.purge_stream(stream, subject=old_chunks)
    return info


async def _purge_quietly(js: JetStreamContext, stream: str, subject: str) -> None:
    """Chunks of a failed write removed, best effort: the write's own error is what the caller
    needs to see (and chunks without metadata are never read)."""
    try:
        await js.purge_stream(stream, subject=subject)
    except Exception:  # the error that made the write fail is raised instead
        pass


async def read_object(js: JetStreamContext, bucket: str, info: ObjectInfo) -> bytes:
    """The chunks ``info`` names in object store ``bucket``, without a consumer, checked against
    its size and digest: ``ObjectGone`` when it is purged meanwhile, ``ObjectCorrupt`` when it
    does not match; NATS's own errors pass through.

    A server that has batched direct gets (2.11 and later) sends up to ``READ_BATCH`` chunks for
    one request; an older one (or a stream without direct gets) answers one message get per
    chunk, a round trip each, which made reading SmolLM2's 11 MB adapter take 140-200 ms."""
    stream = OBJ_STREAM_TEMPLATE.format(bucket=bucket)
    chunks = OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=bucket, obj=info.nuid)
    size = info.size or 0
    # Streamed into a buffer: ``data += chunk`` would be quadratic in the size.
    buffer = io.BytesIO()
    digest = hashlib.sha256()

    def take(data: bytes) -> None:
        buffer.write(data)
        digest.update(data)

    try:
        seq, batched = 1, _has_batched_gets(js)
        while buffer.tell() < size:
            if batched and seq > 1:  # the first chunk, by message get, said where they begin
                seq, batched = await _read_batched(js, stream, chunks, seq, size - buffer.tell(), take)
                continue
            msg = await js.get_msg(stream, seq=seq, subject=chunks, next=True)
            take(msg.data or b"")
            seq = (msg.seq or seq) + 1  # the server always says which message it returned
    except NotFoundError as exc:  # purged: deleted (or replaced) since its metadata was read
        raise ObjectGone(f"{info.name!r} in {bucket} was deleted while it was read") from exc
    if buffer.tell() != size or (info.digest and digest.digest() != _digest_bytes(info.digest)):
        raise ObjectCorrupt(f"{info.name!r} does not match its size and digest in {bucket}")
    return buffer.getvalue()


#: Chunks asked for in one batched direct get (16 MiB at the default 128 KiB chunk, well under a
#: subscription's default pending limit of 64 MiB).
READ_BATCH = 128
_STATUS = "Status"


#: Connections whose batched gets went unanswered: they read chunk by chunk from then on.
_UNANSWERED: weakref.WeakSet = weakref.WeakSet()


def _has_batched_gets(js: JetStreamContext) -> bool:
    if js._nc in _UNANSWERED:
        return False
    version = js._nc.connected_server_version
    try:
        return (version.major, version.minor) >= (2, 11)
    except ValueError:  # a version string that is not semver: ask one chunk at a time
        return False


async def _read_batched(
    js: JetStreamContext, stream: str, subject: str, seq: int, size: int, take: Callable[[bytes], None]
) -> tuple[int, bool]:
    """Chunks of ``subject`` from ``seq`` on, read through batched direct gets until ``size``
    bytes were taken. Returns the sequence to go on from, and False when the rest must be read
    one chunk at a time (the stream has no direct gets, or the request went unanswered).
    ``NotFoundError`` when a chunk is gone."""
    nc = js._nc
    inbox = nc.new_inbox()
    replies = await nc.subscribe(inbox)
    timeout = js._timeout
    taken = 0
    try:
        while taken < size:
            ask = {"seq": seq, "next_by_subj": subject, "batch": READ_BATCH}
            await nc.publish(f"$JS.API.DIRECT.GET.{stream}", json.dumps(ask).encode(), reply=inbox)
            first = True
            while True:
                try:
                    msg = await replies.next_msg(timeout=timeout)
                except NatsTimeoutError:
                    if not first:
                        raise
                    # Nothing at all: credentials from before reads were batched (the server
                    # drops a request they do not allow); this connection reads chunk by chunk.
                    log.warning(
                        "no answer to a batched direct get; reading chunk by chunk from now on "
                        "(regenerate the NATS users to allow $JS.API.DIRECT.GET on object stores)",
                        stream=stream,
                    )
                    _UNANSWERED.add(nc)
                    return seq, False
                first = False
                status = (msg.headers or {}).get(_STATUS)
                if status == "204":  # end of this batch
                    break
                if status == "404":
                    raise NotFoundError
                if status is not None:  # 503: no direct gets on this stream; go on one by one
                    return seq, False
                take(msg.data or b"")
                taken += len(msg.data or b"")
                seq = int((msg.headers or {})["Nats-Sequence"]) + 1
                if taken >= size:
                    break
    finally:
        await replies.unsubscribe()
    return seq, True


def _digest_bytes(digest: str) -> bytes | None:
    """The sha256 in the Object Store's ``SHA-256=<base64url>``; None when it is not one."""
    kind, _, value = digest.partition("=")
    try:
        return base64.urlsafe_b64decode(value) if kind.upper() == "SHA-256" else None
    except ValueError:
        return None
