"""Each trained step as the trainer saved it, in NATS's Object Store: how a step leaves the
trainer's host, in place of a disk shared between services.

Two objects per step in ``artery_trainer_state``, under ``<project>.<model>/<step:06d>/`` (the
model's key, ``subjects.model_key``): ``adapter.tar`` (the packed adapter, what the publisher and
a replica with ``load_saved_adapters`` read) and ``state.tar`` (what else a trainer worker resumes
the step from: optimizer and RNG state, the step's record, and the digest of its adapter).
``checkpoint.saved`` names the adapter as ``nats-object://artery_trainer_state/<object name>``.

A reader trusts such a URI only as far as the event it came in: the bucket must be this one and
the object the event's own project, model and step (``adapter_object``), so that no event can
point a reader at another tenant's adapter. Objects are read as the adapters bucket is
(``shared.object_store.read_object``): in batched direct gets, or a message get a chunk where the
server or the reader's permissions have no batches; no consumer, so a reader needs
``STREAM.MSG.GET`` and ``DIRECT.GET`` only and leaves nothing behind. What is read is checked
against its size and digest.

Errors: a URI or an object refused for good (not there, too large, not the announced bytes)
raises ``InvalidMessage``; NATS not answering raises ``DependencyUnavailable``.
"""

from __future__ import annotations

from nats.js import JetStreamContext
from nats.js.api import ObjectInfo
from nats.js.errors import NotFoundError

from artery.shared import subjects
from artery.shared.adapters import MAX_ADAPTER_BYTES
from artery.shared.errors import DependencyUnavailable, InvalidMessage
from artery.shared.object_store import (
    ObjectCorrupt,
    ObjectGone,
    nats_digest_of_hex,
    object_info,
    put_object,
    read_object,
)

BUCKET = subjects.TRAINER_STATE_BUCKET
SCHEME = "nats-object"
ADAPTER = "adapter.tar"
STATE = "state.tar"
#: Largest step state accepted: the adapter, AdamW's two moments of it (float32) and a little more.
MAX_STATE_BYTES = 4 * MAX_ADAPTER_BYTES
LIMITS = {ADAPTER: MAX_ADAPTER_BYTES, STATE: MAX_STATE_BYTES}


def object_name(project: str, model: str, step: int, kind: str) -> str:
    """``<project>.<model>/<step:06d>/<kind>``; ``kind`` is ``ADAPTER`` or ``STATE``."""
    if kind not in LIMITS:
        raise ValueError(f"{kind!r} is not a trainer-state object ({', '.join(LIMITS)})")
    return f"{subjects.model_key(project, model)}/{step:06d}/{kind}"


def uri(name: str) -> str:
    return f"{SCHEME}://{BUCKET}/{name}"


def is_store_uri(value: str) -> bool:
    return value.startswith(f"{SCHEME}://")


def adapter_object(value: str, project: str, model: str, step: int) -> str:
    """The object ``value`` names, if it is step ``step``'s adapter of ``project``/``model`` in
    this bucket; ``InvalidMessage("uri", ...)`` for anything else (another bucket, another
    tenant's or model's object, another step)."""
    shown = value[:200]
    if not is_store_uri(value):
        raise InvalidMessage("uri", f"{shown!r} is not a {SCHEME}:// URI")
    bucket, _, name = value.removeprefix(f"{SCHEME}://").partition("/")
    if bucket != BUCKET:
        raise InvalidMessage("uri", f"{shown!r} names bucket {bucket[:100]!r}; only {BUCKET} is read")
    if not name.startswith(subjects.model_key(project, model) + "/"):
        raise InvalidMessage(
            "uri", f"{shown!r} names an object of another project or model than {project}/{model}"
        )
    expected = object_name(project, model, step, ADAPTER)
    if name != expected:
        raise InvalidMessage("uri", f"{shown!r} is not step {step}'s adapter ({expected})")
    return name


async def info(js: JetStreamContext, name: str) -> ObjectInfo | None:
    """The object's metadata; None when it is not there (never stored, or deleted)."""
    try:
        return await object_info(js, BUCKET, name)
    except ObjectCorrupt as exc:
        raise InvalidMessage("not_found", f"{BUCKET}: metadata of {name!r} is not valid") from exc
    except Exception as exc:
        raise DependencyUnavailable(f"{BUCKET}: metadata of {name!r} unreadable: {exc!r}") from exc


async def put(js: JetStreamContext, name: str, data: bytes, *, sha256: str | None = None) -> None:
    """Store ``data`` as ``name``; nothing is written when the same bytes are there already (a
    redelivered request uploads its step again, harmlessly). ``sha256``: the hex digest of
    ``data`` when the caller has it."""
    limit = LIMITS[name.rsplit("/", 1)[-1]]
    if len(data) > limit:
        raise InvalidMessage("too_large", f"{name} is {len(data)} bytes, over {limit}")
    try:
        await put_object(js, BUCKET, name, data, sha256=sha256)
    except ObjectCorrupt as exc:
        raise InvalidMessage("not_found", f"{BUCKET}: metadata of {name!r} is not valid") from exc
    except Exception as exc:
        raise DependencyUnavailable(f"{BUCKET}: put of {name!r} failed: {exc!r}") from exc


async def get(
    js: JetStreamContext, name: str, *, sha256: str | None = None, size: int | None = None
) -> bytes:
    """The object's bytes, checked against the store's own size and digest and, when given, the
    announced ``sha256`` (hex) and ``size``."""
    found = await info(js, name)
    if found is None:
        raise InvalidMessage("not_found", f"{name!r} is not in {BUCKET}")
    limit = LIMITS.get(name.rsplit("/", 1)[-1], MAX_ADAPTER_BYTES)
    stored = found.size or 0
    if stored > limit:
        raise InvalidMessage("too_large", f"{name} is {stored} bytes, over {limit}")
    if size is not None and stored != size:
        raise InvalidMessage("size_mismatch", f"{name} is {stored} bytes, announced {size}")
    if found.is_link() or not found.nuid:
        raise InvalidMessage("not_found", f"{name!r} is a link or has no chunks of its own")
    # The bytes are checked against the stored digest as they are read; that digest being the
    # announced one checks them against the announcement without hashing them twice.
    if sha256 is not None and found.digest != nats_digest_of_hex(sha256):
        raise InvalidMessage(
            "sha256_mismatch", f"{name}: sha256 is {found.digest} in the store, announced {sha256}"
        )
    return await _read_chunks(js, found)


async def _read_chunks(js: JetStreamContext, found: ObjectInfo) -> bytes:
    try:
        return await read_object(js, BUCKET, found)
    except ObjectGone as exc:  # purged: deleted or replaced since its metadata was read
        raise InvalidMessage("not_found", str(exc)) from exc
    except ObjectCorrupt as exc:
        raise InvalidMessage("sha256_mismatch", str(exc)) from exc
    except Exception as exc:
        raise DependencyUnavailable(f"{BUCKET}: reading {found.name!r} failed: {exc!r}") from exc


async def newest_step(js: JetStreamContext, project: str, model: str, start: int) -> int | None:
    """The newest step whose state is stored, looked for from ``start`` upwards (a step is
    stored after the one before it, so probing the next one until it is missing finds it): None
    when neither ``start`` nor ``start + 1`` is stored."""
    step = start if start > 0 and await info(js, object_name(project, model, start, STATE)) else None
    nxt = start + 1
    while await info(js, object_name(project, model, nxt, STATE)) is not None:
        step, nxt = nxt, nxt + 1
    return step


async def prune(
    js: JetStreamContext, project: str, model: str, newest: int, kind: str, keep: int
) -> list[int]:
    """Delete ``kind`` of every step below the newest ``keep`` (from ``newest``); the steps deleted.

    Older steps are found by probing down until one is missing (each save prunes, so normally one
    step goes), and deleted oldest first: a failure part way leaves a run of old steps ending at
    the newest pruned one, which the next prune finds again."""
    found: list[int] = []
    step = newest - keep
    while step > 0 and await info(js, object_name(project, model, step, kind)) is not None:
        found.append(step)
        step -= 1
    if not found:
        return []
    try:
        store = await js.object_store(BUCKET)
        for old in reversed(found):
            try:
                await store.delete(object_name(project, model, old, kind))
            except NotFoundError:  # deleted meanwhile (ObjectNotFoundError is a NotFoundError)
                pass
    except Exception as exc:
        raise DependencyUnavailable(f"{BUCKET}: pruning {project}/{model} failed: {exc!r}") from exc
    return sorted(found)
