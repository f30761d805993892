"""Reading the adapter archive the trainer saved, and checking it is what was announced.

Where it is: in the trainer-state store (``nats-object://artery_trainer_state/<object>``, from
any host; ``shared.trainer_state`` checks that the object is the event's own model and step), or,
from a trainer older than that store, a ``file://`` on a filesystem the two share. A message that
can never succeed (another URI, an object or file that is not there, bytes that are not the
announced sha256, an archive a replica would refuse) raises ``InvalidMessage``; a store or file
that cannot be read now (NATS away; permissions, an I/O error on a network volume) raises
``DependencyUnavailable`` and is retried.
"""

from __future__ import annotations

import asyncio
import errno
import io
import stat
import tarfile
from pathlib import Path

from nats.js import JetStreamContext

from artery.schemas import CheckpointSaved
from artery.shared import trainer_state
from artery.shared.adapters import (
    MAX_ADAPTER_BYTES,
    AdapterError,
    check_member_name,
    local_file,
    sha256_hex,
)
from artery.shared.errors import DependencyUnavailable, InvalidMessage

_MISSING = {errno.ENOENT, errno.ENOTDIR}


def locate(saved: CheckpointSaved) -> str | Path:
    """Where ``saved``'s adapter is: its object in the trainer-state store, or a local path."""
    if trainer_state.is_store_uri(saved.uri):
        return trainer_state.adapter_object(saved.uri, saved.project, saved.model, saved.step or 0)
    try:
        return adapter_path(saved.uri)
    except InvalidMessage as exc:
        raise InvalidMessage(
            "uri", f"{exc.reason} (or {trainer_state.SCHEME}://{trainer_state.BUCKET}/<object>)"
        ) from exc


async def fetch_adapter(js: JetStreamContext, where: str | Path, sha256: str, size_bytes: int) -> bytes:
    """The archive ``locate`` found, verified against the announced sha256 and size."""
    if isinstance(where, Path):
        return await asyncio.to_thread(read_adapter, where, sha256, size_bytes)
    data = await trainer_state.get(js, where, sha256=sha256, size=size_bytes)
    check_archive(data)
    return data


def adapter_path(uri: str) -> Path:
    """The local path of a ``file:///abs/path`` URI (``file://localhost/...`` too)."""
    try:
        return local_file(uri)
    except AdapterError as exc:
        raise InvalidMessage("uri", str(exc)) from exc


def read_adapter(path: Path, sha256: str, size_bytes: int) -> bytes:
    """The file's bytes, verified against the announced sha256 and size (blocking: run in a thread)."""
    try:
        info = path.stat()
        if not stat.S_ISREG(info.st_mode):
            raise InvalidMessage("not_a_file", f"{path} is not a regular file")
        if info.st_size > MAX_ADAPTER_BYTES:
            raise InvalidMessage("too_large", f"{path} is {info.st_size} bytes, over {MAX_ADAPTER_BYTES}")
        data = path.read_bytes()
    except OSError as exc:
        if exc.errno in _MISSING:
            raise InvalidMessage("not_found", f"adapter file not found: {path}") from exc
        raise DependencyUnavailable(f"adapter file {path} unreadable: {exc!r}") from exc
    actual = sha256_hex(data)
    if actual != sha256:
        raise InvalidMessage(
            "sha256_mismatch",
            f"{path}: sha256 is {actual} ({len(data)} bytes), announced {sha256} ({size_bytes} bytes)",
        )
    if len(data) != size_bytes:
        raise InvalidMessage("size_mismatch", f"{path} is {len(data)} bytes, announced {size_bytes}")
    check_archive(data)
    return data


def check_archive(data: bytes) -> None:
    """Refuse what every replica's ``unpack_adapter`` would refuse, before it is published."""
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            names = []
            for member in tar.getmembers():
                if not member.isreg():
                    raise AdapterError(f"{member.name!r}: only regular files may be in an adapter")
                check_member_name(member.name)
                names.append(member.name)
    except (tarfile.TarError, AdapterError) as exc:
        raise InvalidMessage("adapter", f"not a valid adapter archive: {exc}") from exc
    if len(set(names)) != len(names):
        raise InvalidMessage("adapter", "a file appears twice in the archive")
    if "adapter_config.json" not in names:
        raise InvalidMessage("adapter", "the archive has no adapter_config.json")
