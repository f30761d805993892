"""A trained step's files: in memory first, then the step directory, and the two archives the
trainer-state store keeps of it.

``StepFiles`` is a step as bytes (``snapshot_step`` takes it from a policy): ``adapter/`` (what
inference loads), the trainer's own files (optimizer and RNG state, the trainer state, and
``step.json``, the request that produced the step) and ``adapter.tar``. The store keeps
``adapter.tar`` and ``state_tar`` (the other files, with the adapter's digest in place of
``adapter/``); ``read_state`` reads a state archive back and ``unpack_state`` makes the step
directory again from it and the adapter, checking every member first. A step's archives hold the
trainer's data formats only (safetensors and JSON, never pickle) and paths inside the step.
"""

from __future__ import annotations

import io
import json
import tarfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from artery.services.trainer.policy import ADAPTER_DIR, TRAINER_STATE, Policy, write_files
from artery.shared.adapters import AdapterError, check_member_name, pack_files

STEP_FILE = "step.json"
ADAPTER_TAR = "adapter.tar"
#: What a step's state archive may hold beside ``adapter/``: the trainer's own data formats
#: (safetensors and JSON, never pickle).
STATE_SUFFIXES = frozenset({".json", ".safetensors"})
#: In a state archive, in place of ``adapter/``: the sha256 and size of the step's ``adapter.tar``,
#: stored beside it; resuming reads that adapter and checks it is this one.
ADAPTER_DIGEST = "adapter_digest.json"


@dataclass(frozen=True)
class StepFiles:
    """A step's checkpoint as bytes: ``adapter`` (the files of ``adapter/``) and ``state`` (the
    trainer's files, ``step.json`` included), each a list of (name, bytes) sorted by name.

    A step is made in memory first (``snapshot_step``): it goes to the trainer-state store from
    there, while ``write`` puts it on disk, so neither waits for the other."""

    adapter: list[tuple[str, bytes]]
    state: list[tuple[str, bytes]]
    #: What inference loads: ``pack_adapter`` of ``adapter/``, the same bytes.
    adapter_tar: bytes

    @classmethod
    def of(cls, adapter: list[tuple[str, bytes]], state: list[tuple[str, bytes]]) -> StepFiles:
        return cls(adapter=adapter, state=state, adapter_tar=pack_files(adapter))

    def state_tar(self, adapter_sha256: str) -> bytes:
        """The step as the store keeps it beside ``adapter_tar`` (whose sha256 is given):
        ``read_state`` and ``unpack_state`` take the two. The same bytes for the same files (sorted,
        owners and times zeroed): a repeated upload is recognised as the object already stored."""
        digest = {"sha256": adapter_sha256, "size_bytes": len(self.adapter_tar)}
        state = [(name, data) for name, data in self.state if name != ADAPTER_DIGEST]
        return pack_files(sorted([*state, (ADAPTER_DIGEST, json.dumps(digest, sort_keys=True).encode())]))

    def write(self, final: Path) -> Path:
        """The step directory ``final``, replaced as a whole (``write_files``)."""
        adapter = [(f"{ADAPTER_DIR}/{name}", data) for name, data in self.adapter]
        return write_files(final, [*adapter, *self.state, (ADAPTER_TAR, self.adapter_tar)])

    @classmethod
    def read(cls, directory: Path) -> StepFiles:
        """A step directory's files; ``ModelUnusable`` for anything but a step's regular files."""
        state = [p for p in sorted(directory.iterdir()) if p.name not in (ADAPTER_TAR, ADAPTER_DIR)]
        adapter = sorted((directory / ADAPTER_DIR).iterdir())
        for path in (*state, *adapter):
            name = path.relative_to(directory).as_posix()
            if path.is_symlink() or not path.is_file():
                raise ModelUnusable(f"{directory}: {name!r} is not a regular file; a step holds files only")
            _check_state_member(name)
        return cls.of(
            adapter=[(path.name, path.read_bytes()) for path in adapter],
            state=[(path.name, path.read_bytes()) for path in state],
        )


def snapshot_step(policy: Policy, step: int, request_id: str, metrics: dict) -> StepFiles:
    """The step ``policy`` has just taken, as files in memory (``step.json``: the request that
    produced it, and its metrics)."""
    record = json.dumps({"step": step, "request_id": request_id, "metrics": metrics}, default=float)
    return StepFiles.of(
        adapter=policy.adapter_files(),
        state=sorted([*policy.state_files(), (STEP_FILE, record.encode())]),
    )


def _check_state_member(name: str) -> None:
    """A step's file: ``adapter/<adapter file>`` or a trainer file at the top; nothing else (no
    directory, no ``..``, no absolute path, no pickle), so unpacking writes inside the step only."""
    parts = PurePosixPath(name).parts
    if "\\" in name or PurePosixPath(name).is_absolute() or any(p in ("", ".", "..") for p in parts):
        raise ModelUnusable(f"{name!r}: not a plain path inside a step")
    if len(parts) == 2 and parts[0] == ADAPTER_DIR:
        try:
            check_member_name(parts[1])
        except AdapterError as exc:
            raise ModelUnusable(str(exc)) from exc
    elif len(parts) != 1 or PurePosixPath(name).suffix not in STATE_SUFFIXES or name == ADAPTER_TAR:
        raise ModelUnusable(f"{name!r}: not a file of a trainer's step")


@dataclass(frozen=True)
class StoredState:
    """A step's state archive, read and checked once (``read_state``): ``files``, the trainer's
    files (and ``adapter/`` in an archive of before), and ``adapter``, the sha256 and size of the
    ``adapter.tar`` it names, or None for an archive that holds ``adapter/`` itself (written before
    the adapter was stored once)."""

    files: list[tuple[str, bytes]]
    adapter: tuple[str, int] | None


def read_state(data: bytes) -> StoredState:
    """A state archive's members, each checked (``_check_state_member``), and the adapter it names;
    ``ModelUnusable`` for one that is not a step's state."""
    members = _read_members(data, "the step's state")
    for name, _ in members:
        _check_state_member(name)
    _check_unique(members, "the step's state")
    files = [(name, content) for name, content in members if name != ADAPTER_DIGEST]
    if len(files) == len(members):  # an archive of before: it holds adapter/ itself
        return StoredState(files=files, adapter=None)
    if any(name.startswith(f"{ADAPTER_DIR}/") for name, _ in files):
        raise ModelUnusable(f"the step's state holds {ADAPTER_DIR}/ and names another adapter")
    content = dict(members)[ADAPTER_DIGEST]
    try:
        digest = json.loads(content)
        sha256, size = digest["sha256"], digest["size_bytes"]
    except (ValueError, TypeError, KeyError) as exc:
        raise ModelUnusable(f"the step's {ADAPTER_DIGEST} is not valid: {exc!r}") from exc
    if not (isinstance(sha256, str) and len(sha256) == 64 and isinstance(size, int) and size >= 0):
        raise ModelUnusable(f"the step's {ADAPTER_DIGEST} is not valid: {digest!r}")
    return StoredState(files=files, adapter=(sha256, size))


def unpack_state(state: StoredState, final: Path, adapter: bytes | None = None) -> Path:
    """A step's state, with the ``adapter`` (``adapter.tar``) it names, as the step directory
    ``final`` (``StepFiles.write``: replaced as a whole); every member is checked before anything
    is written, so ``final`` never holds half a step. The adapter's bytes are written as they were
    stored. An archive that holds ``adapter/`` itself needs no ``adapter``: it is packed from the
    files, as the step that wrote them packed it."""
    if state.adapter is None:
        if adapter is not None:
            raise ModelUnusable(f"the step's state holds {ADAPTER_DIR}/ and names another adapter")
        prefix = f"{ADAPTER_DIR}/"
        inside = [(name.removeprefix(prefix), data) for name, data in state.files if name.startswith(prefix)]
        step = StepFiles.of(
            adapter=sorted(inside),
            state=[(name, data) for name, data in state.files if not name.startswith(prefix)],
        )
    else:
        if adapter is None:
            raise ModelUnusable("the step's state names its adapter, and none was given")
        members = _read_members(adapter, "the step's adapter")
        for name, _ in members:
            _check_state_member(f"{ADAPTER_DIR}/{name}")
        _check_unique(members, "the step's adapter")
        step = StepFiles(adapter=members, state=state.files, adapter_tar=adapter)
    names = {name for name, _ in step.state}
    for needed in (STEP_FILE, TRAINER_STATE):
        if needed not in names:
            raise ModelUnusable(f"the step's state has no {needed}")
    if "adapter_config.json" not in {name for name, _ in step.adapter}:
        raise ModelUnusable(f"the step's state has no {ADAPTER_DIR}/adapter_config.json")
    return step.write(final)


def _check_unique(members: list[tuple[str, bytes]], what: str) -> None:
    names = [name for name, _ in members]
    if len(set(names)) != len(names):
        raise ModelUnusable(f"a file appears twice in {what}")


def _read_members(data: bytes, what: str) -> list[tuple[str, bytes]]:
    """A tar's members (name, content); ``ModelUnusable`` for anything but regular files."""
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            members = []
            for member in tar.getmembers():
                source = tar.extractfile(member) if member.isreg() else None
                if source is None:
                    raise ModelUnusable(f"{member.name!r}: only regular files may be in {what}")
                members.append((member.name, source.read()))
            return members
    except tarfile.TarError as exc:
        raise ModelUnusable(f"{what} is not a valid archive: {exc}") from exc


class ModelUnusable(ValueError):
    """The model's record or its saved step names what cannot be trained, whatever the retry: a
    warm-start adapter that is not one (bad JSON, pickle weights, an adapter on an adapter), a
    LoRA config refused, a step's archive that is not one (``checkpoints``)."""
