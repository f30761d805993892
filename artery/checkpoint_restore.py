"""A pulled step made the model's current step: the trainer's files rebuilt from the pulled copy,
the publisher storing and announcing it (replicas serve ``name@step``), the registry's step moved,
so the next ``train()`` continues from it, optimizer state included. ``artery.s3.pull`` calls it
after downloading; a step older than the model's own stays a file."""

from __future__ import annotations

import asyncio
import json
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from artery.checkpoint_layout import (
    ADAPTER_DIR,
    ADAPTER_TAR,
    OPTIONAL_TRAINER_FILES,
    STEP_FILE,
    TRAINER_FILES,
    TRAINER_SUBDIR,
    CheckpointBackend,
    S3TransportError,
    checkpoint_root,
)
from artery.schemas import CheckpointSaved
from artery.shared import bus, subjects
from artery.shared.adapters import AdapterNotFound, adapter_info, pack_adapter, sha256_hex
from artery.shared.registry import models_kv, read_record
from artery.shared.wakeup import woken_by

if TYPE_CHECKING:
    from artery.model import Model

_IDS = uuid.UUID("0b6f3c52-5a0e-4d59-9c1e-733370756c6c")
#: How long a pull waits for the publisher to store a restored step, and replicas to serve it.
RESTORE_TIMEOUT_S = 180.0


async def restore(
    backend: CheckpointBackend, model: Model, step: int, source: Path, verbose: bool
) -> int | None:
    """Make pulled step ``step`` (in ``source``) the model's current step, if it is newer."""
    kv = models_kv(await backend._js())
    found = await read_record(kv, model.project, model.name)
    current = found.record.step if found else 0
    if step <= current:
        if verbose:
            print(f"{model.project}/{model.name} is at step {current} here; pulled step {step} stays a file")
        return None
    check_identity(model, source.parent.parent / "model.json")
    missing = [n for n in TRAINER_FILES if not (source / TRAINER_SUBDIR / n).is_file()]
    if missing:
        raise S3TransportError(
            f"{model.project}/{model.name} step {step}, pulled to {source}, is an adapter without"
            f" Artery's trainer state ({', '.join(missing)} missing from {TRAINER_SUBDIR}/): its"
            f" optimizer cannot be restored, so it cannot become this model's step {step} (the model"
            f" stays at step {current}). To train on from its weights, use it as a warm start:"
            f" TrainableModel(name=<a new name>, base_model={str(source)!r})"
        )
    recorded = json.loads((source / TRAINER_SUBDIR / STEP_FILE).read_text())
    if recorded.get("step") != step:
        raise S3TransportError(f"{source}: its step.json says step {recorded.get('step')}, not {step}")
    tar = await asyncio.to_thread(_rebuild_trainer_step, checkpoint_root(backend, model), step, source)
    if found is None:  # pulled before register(), as ART's examples do: the record must exist
        await backend.register(model)
    await _publish_step(backend, model, step, tar, recorded.get("metrics") or {})
    await _advance_step(kv, model, step)
    # A LocalBackend starts the model's replica here when the pull came before register() (it is
    # started once; register finds it): register then returns with the pulled step served, not
    # with the base model answering the bare name until the replica's first catch-up.
    await backend._inference_url(model)
    await backend._wait_until_served(model, step, RESTORE_TIMEOUT_S)
    if verbose:
        print(f"{model.project}/{model.name} continues from pulled step {step}")
    return step


def check_identity(model: Model, path: Path) -> None:
    if not path.is_file():
        return  # pushed by ART itself: nothing to compare
    pushed = json.loads(path.read_text())
    mine = getattr(model, "base_model", None)
    if pushed.get("base_model") and mine and pushed["base_model"] != mine:
        raise S3TransportError(
            f"{model.project}/{model.name} in the bucket was trained on {pushed['base_model']!r},"
            f" not {mine!r}: its steps cannot continue on another base model"
        )


def _rebuild_trainer_step(root: Path, step: int, source: Path) -> Path:
    """The trainer's step directory from the pulled files, renamed into place whole."""
    final = root / f"{step:06d}"
    partial = root / f".{step:06d}.pulling"
    shutil.rmtree(partial, ignore_errors=True)
    (partial / ADAPTER_DIR).mkdir(parents=True)
    try:
        for path in source.iterdir():
            if path.is_file():
                shutil.copyfile(path, partial / ADAPTER_DIR / path.name)
        for name in TRAINER_FILES + OPTIONAL_TRAINER_FILES:
            if (source / TRAINER_SUBDIR / name).is_file():
                shutil.copyfile(source / TRAINER_SUBDIR / name, partial / name)
        (partial / ADAPTER_TAR).write_bytes(pack_adapter(partial / ADAPTER_DIR))
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return final / ADAPTER_TAR


async def _publish_step(
    backend: CheckpointBackend, model: Model, step: int, tar: Path, metrics: dict
) -> None:
    """``checkpoint.saved`` for the rebuilt step (as the trainer announces its own), then wait
    until the publisher has stored it: replicas elsewhere fetch it from there, and a push sees it."""
    base_model = getattr(model, "base_model", None)
    if not isinstance(base_model, str):
        raise S3TransportError(f"{model!r} names no base model: a step restores onto a TrainableModel")
    data = await asyncio.to_thread(tar.read_bytes)
    sha = sha256_hex(data)
    event = CheckpointSaved(
        # The same bytes at the same step are the same event: a repeated pull is de-duplicated.
        id=bus.derived_id(_IDS, model.project, model.name, f"pulled:{step}:{sha}"),
        project=model.project,
        model=model.name,
        step=step,
        uri=tar.resolve().as_uri(),
        sha256=sha,
        size_bytes=len(data),
        base_model=base_model,
        metrics={k: float(v) for k, v in metrics.items() if isinstance(v, int | float) and v == v},
    )
    nc = await backend._connect()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + RESTORE_TIMEOUT_S
    published = subjects.checkpoint("published", model.project, model.name)
    async with woken_by(nc, published, waiter="sdk_restore_published") as wake:
        try:
            await bus.publish_event(
                nc.jetstream(), subjects.checkpoint("saved", model.project, model.name), event
            )
        except Exception as exc:  # a secure stack lets only its trainer announce a checkpoint
            raise S3TransportError(
                f"pulled step {step} of {model.project}/{model.name} could not be announced to the"
                f" publisher ({exc!r}); on a secure stack only the trainer may: restore it there"
            ) from exc
        while True:
            wake.clear()
            try:
                await adapter_info(nc.jetstream(), f"{model.project}/{model.name}/{step:06d}")
                wake.satisfied()
                return
            except AdapterNotFound:
                pass
            if loop.time() > deadline:
                raise TimeoutError(
                    f"the publisher did not store pulled step {step} of {model.project}/{model.name}"
                    f" within {RESTORE_TIMEOUT_S:.0f}s (see its log and the DLQ)"
                )
            await wake.wait(2.0)


async def _advance_step(kv, model: Model, step: int) -> None:
    """The registry's step, compare-and-set (a concurrent register keeps its fields)."""
    for _ in range(20):
        found = await read_record(kv, model.project, model.name)
        if found is None or found.record.step >= step:
            return
        try:
            await kv.update(
                subjects.model_key(model.project, model.name),
                msgspec.json.encode(msgspec.structs.replace(found.record, step=step)),
                found.revision,
            )
            return
        except Exception:  # written in between: read again
            await asyncio.sleep(0.05)
    raise S3TransportError(f"could not move {model.project}/{model.name} to step {step} in the registry")
