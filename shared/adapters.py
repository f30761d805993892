"""LoRA adapters in transit: a deterministic tar of safe files, checked by sha256, in the Object Store.

An adapter crosses machines as bytes that a replica loads into its engine, so the archive may
hold only data formats: ``adapter_config.json``, ``*.safetensors`` and tokenizer files. Pickle
based weights (``*.bin``, ``*.pt``...) are refused on both sides — loading them runs code.
The archive is deterministic (sorted names, zeroed owners and times), so the same adapter
always has the same sha256 and a re-publish is recognisably the same object.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import json
import os
import shutil
import stat
import tarfile
import tempfile
import weakref
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from urllib.parse import unquote, urlsplit

from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.api import Header, ObjectInfo, ObjectMetaOptions
from nats.js.errors import NotFoundError, ObjectNotFoundError
from nats.js.kv import MSG_ROLLUP_SUBJECT
from nats.js.object_store import (
    OBJ_CHUNKS_PRE_TEMPLATE,
    OBJ_DEFAULT_CHUNK_SIZE,
    OBJ_DIGEST_TEMPLATE,
    OBJ_META_PRE_TEMPLATE,
    OBJ_STREAM_TEMPLATE,
)

from artery.shared import subjects
from artery.shared.bus import Outgoing, publish_prepared
from artery.shared.errors import ArteryError
from artery.shared.logs import get_logger

log = get_logger(__name__)

#: Suffixes of formats that unpickle (run code) when loaded: never packed, never unpacked.
PICKLE_SUFFIXES = frozenset({".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".npy", ".npz"})
#: Tokenizer and chat-template files that may travel with an adapter (``*.jinja``: the chat
#: template newer transformers saves beside the tokenizer).
TOKENIZER_SUFFIXES = frozenset({".json", ".txt", ".model", ".jinja"})
ALLOWED_NAMES = frozenset({"adapter_config.json", "README.md"})
#: Largest adapter accepted (LoRA adapters are MBs; a GB-sized archive is a mistake or an attack).
MAX_ADAPTER_BYTES = 2 * 1024**3


class AdapterError(ArteryError):
    """An adapter archive is unsafe, corrupt or not what was announced."""


class AdapterNotFound(AdapterError):
    pass


def local_file(uri: str) -> Path:
    """The path of a ``file:///abs/path`` URI (``file://localhost/...`` too): where the trainer
    wrote an adapter, as the publisher and a replica on the same filesystem read it."""
    parts = urlsplit(uri)
    if parts.scheme != "file":
        raise AdapterError(f"only file:// URIs are accepted, not {uri[:200]!r}")
    if parts.netloc not in ("", "localhost"):
        raise AdapterError(f"{uri[:200]!r} names host {parts.netloc!r}; only this machine's files are read")
    if parts.query or parts.fragment:
        raise AdapterError(f"{uri[:200]!r}: a file URI has no query or fragment")
    path = Path(unquote(parts.path))
    if not path.is_absolute():
        raise AdapterError(f"{uri[:200]!r}: the path must be absolute")
    return path


def read_archive_file(path: Path, max_bytes: int = MAX_ADAPTER_BYTES) -> bytes:
    """The bytes of an adapter archive a message names by path: a regular file of at most
    ``max_bytes``. A device (``/dev/zero``), a FIFO (which would block the reader for good) or a
    directory raises ``AdapterError`` before anything is read; the checks are made on the opened
    file itself, so a path swapped in between cannot slip past them. ``OSError`` when unreadable."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise AdapterError(f"{path} is not a regular file")
        if info.st_size > max_bytes:
            raise AdapterError(f"{path} is {info.st_size} bytes, over {max_bytes}")
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:  # grew while it was read
        raise AdapterError(f"{path} is over {max_bytes} bytes")
    return data


def check_member_name(name: str) -> None:
    """Accept only a plain file name (no directory, no ``..``) of an allowed kind."""
    path = PurePosixPath(name)
    if path.is_absolute() or len(path.parts) != 1 or name in ("", ".", "..") or "\\" in name:
        raise AdapterError(f"{name!r}: only plain file names are allowed in an adapter")
    suffix = path.suffix.lower()
    if suffix in PICKLE_SUFFIXES:
        raise AdapterError(f"{name!r}: pickle-based weights are refused; save with safetensors")
    if name not in ALLOWED_NAMES and suffix != ".safetensors" and suffix not in TOKENIZER_SUFFIXES:
        raise AdapterError(
            f"{name!r}: not an adapter file (adapter_config.json, *.safetensors, tokenizer files, README.md)"
        )


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def pack_adapter(directory: str | os.PathLike) -> bytes:
    """A tar of the adapter's files; raises ``AdapterError`` on anything but allowed regular files."""
    root = Path(directory)
    if not (root / "adapter_config.json").is_file():
        raise AdapterError(f"{root}: no adapter_config.json (not a PEFT adapter directory)")
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(root.iterdir(), key=lambda p: p.name):
            if path.is_symlink() or not path.is_file():
                raise AdapterError(f"{path.name!r}: only regular files are packed (no links, no folders)")
            check_member_name(path.name)
            data = path.read_bytes()
            info = tarfile.TarInfo(path.name)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def unpack_adapter(data: bytes, dest: str | os.PathLike, expected_sha256: str) -> Path:
    """Verify, check every member, then extract into ``dest`` (replaced as a whole).

    Nothing is written unless the hash matches and every member is allowed; the files land in
    a temporary sibling first and are renamed into place, so ``dest`` never holds half an
    adapter.
    """
    actual = sha256_hex(data)
    if actual != expected_sha256:
        raise AdapterError(f"sha256 mismatch: expected {expected_sha256}, got {actual}")
    dest = Path(dest)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        members = tar.getmembers()
        seen: set[str] = set()
        for member in members:
            if not member.isreg():
                raise AdapterError(f"{member.name!r}: only regular files may be unpacked")
            check_member_name(member.name)
            if member.name in seen:
                raise AdapterError(f"{member.name!r}: appears twice in the archive")
            seen.add(member.name)
        if "adapter_config.json" not in seen:
            raise AdapterError("archive has no adapter_config.json")
        dest.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
        try:
            # filter="data" is the standard library's own guard (no links, no special files,
            # no paths outside the target) on top of the checks above. Python before 3.11.4
            # (Debian 12 has 3.11.2) has no filters: there the checks above are the guard.
            if hasattr(tarfile, "data_filter"):
                tar.extractall(staging, members=members, filter="data")
            else:
                tar.extractall(staging, members=members)
            if dest.exists():
                shutil.rmtree(dest)
            staging.rename(dest)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return dest


async def put_adapter(js: JetStreamContext, object_name: str, data: bytes):
    """Store the packed adapter under ``object_name``; returns the store's ``ObjectInfo``."""
    return await write_object(js, subjects.ADAPTERS_BUCKET, object_name, data)


#: Chunks in flight at once while writing (32 MiB): a step's state of GBs is not copied whole
#: into the connection's buffer, and the acks keep coming while the next window is sent.
WRITE_WINDOW = 256


async def write_object(js: JetStreamContext, bucket: str, name: str, data: bytes) -> ObjectInfo:
    """Store ``data`` as ``name`` in object store ``bucket``, as nats-py's ``ObjectStore.put``
    lays it out (chunks on a new subject, then the metadata rolled up, then the previous
    version's chunks purged), but with the chunks pipelined: ``put`` waits for each chunk's ack
    before it sends the next, one round trip per 128 KiB, which made a step's upload (tens of MB
    for SmolLM2's adapter and optimizer state) a third of the trainer's time outside training.
    The chunks go out in order on one connection, so the stream holds them in order; the
    metadata is published only after every chunk is acked, so a reader never sees an object
    whose chunks are not all stored. A failure purges the chunks sent and raises."""
    store = await js.object_store(bucket)  # the bucket must exist (and the caller may see it)
    try:
        previous: ObjectInfo | None = await store.get_info(name)
    except (ObjectNotFoundError, NotFoundError):
        previous = None
    nuid = js._nc._nuid.next().decode()  # nats-py's own id source, as ``put`` uses
    stream = OBJ_STREAM_TEMPLATE.format(bucket=bucket)
    chunk_subject = OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=bucket, obj=nuid)
    starts = range(0, len(data), OBJ_DEFAULT_CHUNK_SIZE)
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).decode()
    info = ObjectInfo(
        name=name,
        bucket=bucket,
        nuid=nuid,
        size=len(data),
        chunks=len(starts),
        digest=OBJ_DIGEST_TEMPLATE.format(digest=digest),
        options=ObjectMetaOptions(max_chunk_size=OBJ_DEFAULT_CHUNK_SIZE),
        mtime=datetime.now(UTC).isoformat(),
    )
    meta_subject = OBJ_META_PRE_TEMPLATE.format(
        bucket=bucket, obj=base64.urlsafe_b64encode(name.encode()).decode()
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
        await js.publish(meta_subject, meta, headers={Header.ROLLUP: MSG_ROLLUP_SUBJECT})
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


async def get_adapter(js: JetStreamContext, object_name: str) -> bytes:
    """The stored archive of ``object_name``; ``AdapterNotFound`` at once when it is not there.

    Read chunk by chunk with message gets, not with nats-py's ``ObjectStore.get``: that reads the
    chunks through an ordered consumer, and when the object is deleted between its metadata and
    its chunks (retention deleting the previous step as the next is published) it waits forever
    for chunks that were purged, its consumer left on the stream with nothing pending. A get by
    subject answers "not found" instead, each request is bounded by the context's timeout, and no
    consumer is left behind when a caller gives up.
    """
    return await read_adapter(js, await adapter_info(js, object_name))


async def adapter_info(js: JetStreamContext, object_name: str) -> ObjectInfo:
    store = await js.object_store(subjects.ADAPTERS_BUCKET)
    try:
        info = await store.get_info(object_name)  # a deleted object is not found too
    except (ObjectNotFoundError, NotFoundError) as exc:
        raise AdapterNotFound(f"adapter {object_name!r} is not in {subjects.ADAPTERS_BUCKET}") from exc
    if (info.size or 0) > MAX_ADAPTER_BYTES:
        raise AdapterError(f"adapter {object_name!r} is {info.size} bytes, over the limit")
    if info.is_link() or not info.nuid:
        raise AdapterError(f"adapter {object_name!r} is a link or has no chunks of its own")
    return info


async def read_adapter(js: JetStreamContext, info: ObjectInfo) -> bytes:
    """The chunks ``info`` names, checked against its size and digest."""
    return await read_object(js, subjects.ADAPTERS_BUCKET, info)


async def read_object(js: JetStreamContext, bucket: str, info: ObjectInfo) -> bytes:
    """The chunks ``info`` names in object store ``bucket``, without a consumer, checked against
    its size and digest: ``AdapterNotFound`` when it is purged meanwhile, ``AdapterError`` when it
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
        raise AdapterNotFound(f"{info.name!r} in {bucket} was deleted while it was read") from exc
    if buffer.tell() != size or (info.digest and digest.digest() != _digest_bytes(info.digest)):
        raise AdapterError(f"{info.name!r} does not match its size and digest in {bucket}")
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
