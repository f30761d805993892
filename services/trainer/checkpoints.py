"""Checkpoints on disk: one directory per step, written atomically, and the policies in memory.

Layout: ``<checkpoint_dir>/<project>/<model>/<step:06d>/`` holding ``adapter/`` (what inference
loads), the optimizer state (safetensors + JSON, never pickle), ``adapter.tar`` (what the
publisher reads, through the store) and ``step.json`` (the request that produced it, and its
metrics). A step directory is written under a temporary name and renamed into place, so a crash
leaves either the whole step or nothing. What a step holds, in memory, on disk and in the store's
archives, is ``step_files``.

The disk is this worker's cache; the trainer-state store (``shared.trainer_state``) is what every
worker shares. Each saved step goes there as ``adapter.tar`` and ``state.tar`` (the step's other
files, and the digest of its adapter in place of ``adapter/``: the adapter is stored once), and
``PolicyCache.get`` resumes a model from the newest step anywhere: a worker with an empty (or
stale) disk takes the step another worker saved, optimizer state and ``step.json`` included, so a
redelivered request is recognised there too. A state archive of before holds ``adapter/`` itself,
and restores as it did.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import msgspec
from nats.js import JetStreamContext

from artery.schemas import ModelRecord
from artery.services.trainer.lora import warm_start_lora
from artery.services.trainer.policy import TRAINER_STATE, LoraSettings, OptimSettings, Policy
from artery.services.trainer.settings import TrainerSettings
from artery.services.trainer.slots import LoraSlots
from artery.services.trainer.step_files import (
    ADAPTER_TAR,
    STEP_FILE,
    ModelUnusable,
    read_state,
    snapshot_step,
    unpack_state,
)
from artery.services.trainer.torch_thread import TorchThread
from artery.shared import trainer_state
from artery.shared.errors import DependencyUnavailable, InvalidMessage
from artery.shared.logs import get_logger
from artery.shared.object_store import nats_digest

log = get_logger(__name__)


def model_dir(settings: TrainerSettings, record: ModelRecord) -> Path:
    return Path(settings.checkpoint_dir) / record.project / record.name


def step_dir(settings: TrainerSettings, record: ModelRecord, step: int) -> Path:
    return model_dir(settings, record) / f"{step:06d}"


def latest_step(settings: TrainerSettings, record: ModelRecord) -> int:
    """The highest complete step on disk; 0 (the base model) when there is none."""
    root = model_dir(settings, record)
    steps = [int(p.name) for p in root.glob("[0-9]" * 6) if (p / STEP_FILE).exists()] if root.exists() else []
    return max(steps, default=0)


def step_for_request(
    settings: TrainerSettings, record: ModelRecord, request_id: str
) -> tuple[int, dict] | None:
    """The step a request already produced (found in a step's record, newest first), if any.

    Not only the latest: a request that saved its step but could not record it (PostgreSQL
    down, a crash) may be redelivered after another request has trained on top of it."""
    root = model_dir(settings, record)
    if not root.exists():
        return None
    for path in sorted(root.glob("[0-9]" * 6), reverse=True):
        step_file = path / STEP_FILE
        if step_file.exists():
            info = json.loads(step_file.read_text())
            if info.get("request_id") == request_id:
                return int(path.name), info["metrics"]
    return None


def lora_settings(settings: TrainerSettings, record: ModelRecord) -> LoraSettings:
    """Trainer defaults, overridden per model by the ``lora`` given at registration
    (``art.LoRAConfig``; older records carried it as ``config["lora"]``)."""
    spec = record.lora
    overrides = (
        {k: v for k, v in msgspec.structs.asdict(spec).items() if v is not None}
        if spec is not None
        else dict(record.config.get("lora") or {})
    )
    warm = warm_start_lora(record.base_model)
    if warm is not None:  # a warm start trains the adapter it starts from: its shape is the model's
        wanted = {"rank": warm.rank, "alpha": warm.alpha, "target_modules": list(warm.target_modules)}
        given = {k: v for k, v in overrides.items() if k in wanted}
        if "target_modules" in given:
            given["target_modules"] = sorted(given["target_modules"])
        if "alpha" in given:
            given["alpha"] = float(given["alpha"])
        if any(wanted[k] != v for k, v in given.items()):
            raise LoraChanged(
                f"{record.project}/{record.name} warm-starts from the adapter {record.base_model}"
                f" ({wanted}) but is registered with LoRA {given}: leave the LoRA config out"
            )
        return warm
    return LoraSettings(
        rank=int(overrides.get("rank", settings.lora_rank)),
        alpha=float(overrides.get("alpha", settings.lora_alpha)),
        dropout=float(overrides.get("dropout", 0.0)),
        target_modules=tuple(
            overrides.get("target_modules")
            or [m.strip() for m in settings.lora_target_modules.split(",") if m.strip()]
        ),
    )


def optim_settings(settings: TrainerSettings) -> OptimSettings:
    return OptimSettings(micro_batch_size=settings.micro_batch_size)


def save_step(
    settings: TrainerSettings, record: ModelRecord, policy: Policy, step: int, request_id: str, metrics: dict
) -> Path:
    """``snapshot_step``, written into the step's directory."""
    return snapshot_step(policy, step, request_id, metrics).write(step_dir(settings, record, step))


class LoraChanged(ModelUnusable):
    """The model was registered with another adapter shape than its checkpoints were trained with."""


def check_lora_unchanged(settings: TrainerSettings, record: ModelRecord, step: int) -> None:
    """Raise ``LoraChanged`` when ``record`` asks for another LoRA than step ``step`` was saved with."""
    if step == 0:
        return
    state_file = step_dir(settings, record, step) / TRAINER_STATE
    saved = json.loads(state_file.read_text())["lora"]
    wanted = lora_settings(settings, record)
    saved_shape = (saved["rank"], float(saved["alpha"]), tuple(saved["target_modules"]))
    if saved_shape != (wanted.rank, float(wanted.alpha), wanted.target_modules):
        raise LoraChanged(
            f"{record.project}/{record.name} was trained up to step {step} with LoRA rank {saved['rank']},"
            f" alpha {saved['alpha']}, target modules {list(saved['target_modules'])}; it is now registered"
            f" with rank {wanted.rank}, alpha {wanted.alpha}, target modules {list(wanted.target_modules)}."
            " An adapter's shape cannot change: register a new model name for another LoRA config"
        )


class PolicyCache:
    """The policies of the models trained last, kept in memory between steps: up to
    ``settings.lora_slots`` of them, the least recently used evicted, those on one base model
    sharing its weights (``slots``).

    With ``js``, each ``get`` first takes from the trainer-state store a newer step than the disk
    holds (another worker's), or the store's copy of the disk's newest step when the two differ
    (this worker saved a step it never uploaded, and another trained that step again)."""

    def __init__(self, settings: TrainerSettings, js: JetStreamContext | None = None):
        self.settings = settings
        self.js = js
        self.slots = LoraSlots(settings.lora_slots, settings.base_model_slots)
        #: Where the policies' tensors are touched: loads here, steps and snapshots by the trainer.
        self.thread = TorchThread()
        #: The model last asked for: the one whose step is running, which ``forget`` drops.
        self._current: tuple[str, str] | None = None

    async def get(self, record: ModelRecord) -> tuple[Policy, int]:
        key = (record.project, record.name)
        self._current = key
        on_disk = latest_step(self.settings, record)
        slot = self.slots.get(key)
        cached = slot is not None and slot.step == on_disk
        on_disk = await self._from_store(record, on_disk, cached=cached)
        try:
            check_lora_unchanged(self.settings, record, on_disk)
            if slot is None or slot.step != on_disk:
                await self.thread.run(self._load, record, on_disk)
                slot = self.slots.get(key)
        except ModelUnusable:
            raise
        except ValueError as exc:  # what the record names is refused (shared.models, lora.py)
            raise ModelUnusable(f"{record.project}/{record.name}: {exc}") from exc
        assert slot is not None  # loaded, or raised
        return slot.policy, slot.step

    async def _from_store(self, record: ModelRecord, on_disk: int, *, cached: bool) -> int:
        """The step to load: ``on_disk``, or the newest one in the store, unpacked into place."""
        if self.js is None:
            return on_disk
        project, model = record.project, record.name
        try:
            newest = await trainer_state.newest_step(self.js, project, model, max(on_disk, record.step))
            if newest is None or newest < on_disk:
                if record.step > on_disk:
                    log.warning(
                        "the registry's step is neither on disk nor stored; resuming from disk",
                        project=project,
                        model=model,
                        registry_step=record.step,
                        on_disk=on_disk,
                    )
                return on_disk
            if newest == on_disk and (cached or await self._same_as_stored(record, on_disk)):
                return on_disk
            name = trainer_state.object_name(project, model, newest, trainer_state.STATE)
            state = await asyncio.to_thread(read_state, await trainer_state.get(self.js, name))
            adapter = None
            if state.adapter is not None:  # stored beside the state, and checked to be the one it names
                sha256, size = state.adapter
                name = trainer_state.object_name(project, model, newest, trainer_state.ADAPTER)
                adapter = await trainer_state.get(self.js, name, sha256=sha256, size=size)
        except InvalidMessage as exc:  # the store's trouble, never the request's: asked again later
            raise DependencyUnavailable(f"{project}/{model} step state unreadable: {exc}") from exc
        await asyncio.to_thread(unpack_state, state, step_dir(self.settings, record, newest), adapter)
        log.info(
            "step taken from the trainer-state store",
            project=project,
            model=model,
            step=newest,
            on_disk=on_disk,
        )
        return newest

    async def _same_as_stored(self, record: ModelRecord, step: int) -> bool:
        """Whether the disk's step ``step`` is the one stored (its adapter's digest), or none is."""
        assert self.js is not None
        name = trainer_state.object_name(record.project, record.name, step, trainer_state.ADAPTER)
        stored = await trainer_state.info(self.js, name)
        if stored is None:
            return True
        try:
            local = await asyncio.to_thread((step_dir(self.settings, record, step) / ADAPTER_TAR).read_bytes)
        except OSError:  # a step without its archive: the stored one replaces it
            return False
        return stored.digest == nats_digest(local)

    def _load(self, record: ModelRecord, step: int) -> Policy:
        if record.base_model is None:  # refused before any step is asked of it (service.py)
            raise ModelUnusable(f"{record.project}/{record.name} has no base model")
        lora, optim = lora_settings(self.settings, record), optim_settings(self.settings)
        if step == 0:
            log.info("new adapter", project=record.project, model=record.name, base_model=record.base_model)
        else:
            log.info("resuming", project=record.project, model=record.name, step=step)
        return self.slots.load(
            (record.project, record.name),
            record.base_model,
            lora,
            optim,
            device=self.settings.device,
            checkpoint=step_dir(self.settings, record, step) if step else None,
            step=step,
        )

    def forget(self, record: ModelRecord | None = None) -> None:
        """Drop ``record``'s policy (None: the model last asked for, whose step failed) from
        memory: its next ``get`` loads its last saved step again. Other models keep their slots:
        a step of one never touches another's adapter or optimizer."""
        key = (record.project, record.name) if record is not None else self._current
        if key is not None:
            self.slots.drop(key)

    def advance(self, record: ModelRecord, step: int) -> None:
        slot = self.slots.get((record.project, record.name))
        if slot is not None:
            slot.step = step
