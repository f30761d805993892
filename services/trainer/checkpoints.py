"""Checkpoints on disk: one directory per step, written atomically, and the policies in memory.

Layout: ``<checkpoint_dir>/<project>/<model>/<step:06d>/`` holding ``adapter/`` (what inference
loads), the optimizer state (safetensors + JSON, never pickle), ``adapter.tar`` (what the
publisher uploads) and ``step.json`` (the request that produced it, and its metrics). A step
directory is written under a temporary name and renamed into place, so a crash leaves either the
whole step or nothing; a restarted trainer resumes from the highest complete step.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import msgspec

from artery.schemas import ModelRecord
from artery.services.trainer.lora import warm_start_lora
from artery.services.trainer.policy import TRAINER_STATE, LoraSettings, OptimSettings, Policy
from artery.services.trainer.settings import TrainerSettings
from artery.shared.adapters import pack_adapter, sha256_hex
from artery.shared.logs import get_logger
from artery.shared.models import resolve_base_model

log = get_logger(__name__)
STEP_FILE = "step.json"
ADAPTER_TAR = "adapter.tar"


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
    final = step_dir(settings, record, step)
    partial = final.with_name(final.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    policy.save(partial)
    (partial / ADAPTER_TAR).write_bytes(pack_adapter(partial / "adapter"))
    (partial / STEP_FILE).write_text(
        json.dumps({"step": step, "request_id": request_id, "metrics": metrics}, default=float)
    )
    shutil.rmtree(final, ignore_errors=True)
    partial.rename(final)
    return final


def packed_adapter(settings: TrainerSettings, record: ModelRecord, step: int) -> tuple[Path, str, int]:
    path = step_dir(settings, record, step) / ADAPTER_TAR
    data = path.read_bytes()
    return path, sha256_hex(data), len(data)


class ModelUnusable(ValueError):
    """The model's record names what cannot be trained, whatever the retry: a warm-start adapter
    that is not one (bad JSON, pickle weights, an adapter on an adapter), a LoRA config refused."""


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
    """The policy of the model last trained, kept in memory between steps (one at a time)."""

    def __init__(self, settings: TrainerSettings):
        self.settings = settings
        self._key: tuple[str, str] | None = None
        self._policy: Policy | None = None
        self._step = 0

    async def get(self, record: ModelRecord) -> tuple[Policy, int]:
        import asyncio

        key = (record.project, record.name)
        on_disk = latest_step(self.settings, record)
        try:
            check_lora_unchanged(self.settings, record, on_disk)
            if self._key != key or self._policy is None or self._step != on_disk:
                self._policy = await asyncio.to_thread(self._load, record, on_disk)
                self._key, self._step = key, on_disk
        except ModelUnusable:
            raise
        except ValueError as exc:  # what the record names is refused (shared.models, lora.py)
            raise ModelUnusable(f"{record.project}/{record.name}: {exc}") from exc
        return self._policy, self._step

    def _load(self, record: ModelRecord, step: int) -> Policy:
        if record.base_model is None:  # refused before any step is asked of it (service.py)
            raise ModelUnusable(f"{record.project}/{record.name} has no base model")
        base = resolve_base_model(record.base_model)
        lora, optim = lora_settings(self.settings, record), optim_settings(self.settings)
        if step == 0:
            log.info("new adapter", project=record.project, model=record.name, base_model=record.base_model)
            return Policy.create(base, lora, optim, device=self.settings.device)
        log.info("resuming", project=record.project, model=record.name, step=step)
        return Policy.restore(
            step_dir(self.settings, record, step), base, lora, optim, device=self.settings.device
        )

    def forget(self) -> None:
        """Drop the policy in memory: the next ``get`` loads the last saved step again."""
        self._key, self._policy, self._step = None, None, 0

    def advance(self, record: ModelRecord, step: int) -> None:
        if self._key == (record.project, record.name):
            self._step = step
