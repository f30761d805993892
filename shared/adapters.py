"""LoRA adapters in transit: a deterministic tar of safe files, checked by sha256, in the Object Store.

An adapter crosses machines as bytes that a replica loads into its engine, so the archive may
hold only data formats: ``adapter_config.json``, ``*.safetensors`` and tokenizer files. Pickle
based weights (``*.bin``, ``*.pt``...) are refused on both sides — loading them runs code.
The archive is deterministic (sorted names, zeroed owners and times), so the same adapter
always has the same sha256 and a re-publish is recognisably the same object.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import stat
import tarfile
import tempfile
from collections.abc import Iterable
from pathlib import Path, PurePosixPath
from urllib.parse import unquote, urlsplit

from nats.js import JetStreamContext
from nats.js.api import ObjectInfo

from artery.shared import subjects
from artery.shared.errors import ArteryError
from artery.shared.logs import get_logger
from artery.shared.object_store import ObjectCorrupt, ObjectGone, object_info, put_object, read_object

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
    files = []
    for path in sorted(root.iterdir(), key=lambda p: p.name):
        if path.is_symlink() or not path.is_file():
            raise AdapterError(f"{path.name!r}: only regular files are packed (no links, no folders)")
        check_member_name(path.name)
        files.append((path.name, path.read_bytes()))
    return pack_files(files)


def pack_files(files: Iterable[tuple[str, bytes]]) -> bytes:
    """A tar of ``files`` (name and content, in the order given), owners and times zeroed, mode
    0644: byte for byte what ``tarfile`` writes in PAX format for the same members, so archives
    packed before and after this function existed have the same sha256.

    Built as one join of headers, contents and padding: ``tarfile.addfile`` copies each member
    through 16 KiB reads into a growing buffer, and a step's adapter and state are tens of MB
    packed on the path between a training step and the replicas serving it."""
    parts: list[bytes] = []
    offset = 0
    for name, data in files:
        info = tarfile.TarInfo(name)
        info.size, info.mode, info.mtime = len(data), 0o644, 0
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        header = info.tobuf(tarfile.PAX_FORMAT, tarfile.ENCODING, "surrogateescape")
        padding = -len(data) % tarfile.BLOCKSIZE
        parts += (header, data, tarfile.NUL * padding)
        offset += len(header) + len(data) + padding
    end = 2 * tarfile.BLOCKSIZE  # the end-of-archive marker, then zeros to a whole record
    end += -(offset + end) % tarfile.RECORDSIZE
    parts.append(tarfile.NUL * end)
    return b"".join(parts)


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


async def put_adapter(js: JetStreamContext, object_name: str, data: bytes, *, sha256: str | None = None):
    """Store the packed adapter under ``object_name`` unless the same bytes are there already (a
    publisher redelivered after a crash puts it again); returns the store's ``ObjectInfo``.
    ``sha256``: the archive's hex digest when the caller has it."""
    return await put_object(js, subjects.ADAPTERS_BUCKET, object_name, data, sha256=sha256)


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
    try:
        info = await object_info(js, subjects.ADAPTERS_BUCKET, object_name)
    except ObjectCorrupt as exc:
        raise AdapterError(str(exc)) from exc
    if info is None:  # never stored, or deleted
        raise AdapterNotFound(f"adapter {object_name!r} is not in {subjects.ADAPTERS_BUCKET}")
    if (info.size or 0) > MAX_ADAPTER_BYTES:
        raise AdapterError(f"adapter {object_name!r} is {info.size} bytes, over the limit")
    if info.is_link() or not info.nuid:
        raise AdapterError(f"adapter {object_name!r} is a link or has no chunks of its own")
    return info


async def read_adapter(js: JetStreamContext, info: ObjectInfo) -> bytes:
    """The chunks ``info`` names, checked against its size and digest."""
    try:
        return await read_object(js, subjects.ADAPTERS_BUCKET, info)
    except ObjectGone as exc:
        raise AdapterNotFound(str(exc)) from exc
    except ObjectCorrupt as exc:
        raise AdapterError(str(exc)) from exc
