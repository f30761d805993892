"""LoRA slots: the models a trainer worker keeps in memory, sharing their base models' weights.

A worker keeps up to ``capacity`` models (``ARTERY_TRAINER_LORA_SLOTS``), on at most
``base_capacity`` base models (``ARTERY_TRAINER_BASE_MODEL_SLOTS``, 1 by default). Models whose base
weights are the same (the same directory or name, dtype and device) share one copy of them: one
PEFT model holds an adapter per model, each under a name of its own, and each model's ``Policy``
has its own AdamW optimizer over its own adapter's parameters. ``Policy.activate`` makes an adapter
the one the model runs and the only one whose parameters require grad, so a step of one model
never reaches another's adapter or optimizer state. Each model keeps its own LoRA shape (rank,
alpha, target modules): PEFT adds an adapter of any shape beside the others.

Load: a model not in a slot is restored from a saved step (or made fresh at step 0) into its
base, loading the base first when no slot holds it. Evict: the least recently used model makes
room when the slots are full; nothing is lost, every step being saved when it is trained. Its
adapter is deleted from the base and its optimizer dropped with its policy; a base left without
models is freed.

One step at a time: a base's active adapter is one piece of state, switched by whichever policy
trains; the trainer service runs one request at a time.

On CUDA with Unsloth, a model loads through ``Policy.create`` as before, on a base of its own:
Unsloth's patched models are not shared.
"""

from __future__ import annotations

import gc
import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from artery.services.trainer.lora import (
    LoraSettings,
    attach_lora,
    base_weights_path,
    effective_lora,
    load_base,
    tokenizer_path,
    unsloth_available,
    warm_start_lora,
)
from artery.services.trainer.memory import release_freed_memory
from artery.services.trainer.policy import OptimSettings, Policy, cuda_devices, read_checkpoint, resolve_dtype
from artery.shared.logs import get_logger
from artery.shared.models import resolve_base_model

log = get_logger(__name__)
#: A model in a slot: (project, model name).
ModelKey = tuple[str, str]


@dataclass(frozen=True)
class BaseKey:
    """What makes two models' base weights one copy."""

    weights: str
    dtype: torch.dtype
    device: torch.device


@dataclass(eq=False)
class SharedBase:
    """One copy of base weights: ``model`` is the PEFT model holding the adapters of ``adapters``."""

    key: BaseKey
    model: Any
    adapters: set[str] = field(default_factory=set)
    tokenizers: dict[str, Any] = field(default_factory=dict)

    def tokenizer(self, path: str) -> Any:
        if path not in self.tokenizers:
            from transformers import AutoTokenizer

            self.tokenizers[path] = AutoTokenizer.from_pretrained(path)
        return self.tokenizers[path]


@dataclass(eq=False)
class Slot:
    """A model in memory: its policy, the step the policy is at, and the base it shares (None:
    a base of its own)."""

    policy: Policy
    step: int
    base: SharedBase | None


def adapter_name(key: ModelKey) -> str:
    """The model's adapter name on a shared base: the same in every worker and at every load (a
    digest: model names may hold dots, which PEFT's module names cannot)."""
    return "model_" + hashlib.sha256("\0".join(key).encode()).hexdigest()[:16]


class LoraSlots:
    """Up to ``capacity`` models' policies, least recently used first out."""

    def __init__(self, capacity: int, base_capacity: int = 1) -> None:
        if capacity < 1 or base_capacity < 1:
            raise ValueError("a worker needs at least one LoRA slot and one base-model slot")
        self.capacity = capacity
        #: Base models held at once: each is a whole model's weights (GiBs on a GPU), where an
        #: adapter is MiBs, so models on other bases are evicted before a new base loads.
        self.base_capacity = base_capacity
        self._slots: OrderedDict[ModelKey, Slot] = OrderedDict()  # least recently used first
        self._bases: dict[BaseKey, SharedBase] = {}

    def __len__(self) -> int:
        return len(self._slots)

    def get(self, key: ModelKey) -> Slot | None:
        """The model's slot, now the most recently used; None when it is not in memory."""
        slot = self._slots.get(key)
        if slot is not None:
            self._slots.move_to_end(key)
        return slot

    def bases(self) -> list[SharedBase]:
        """The base models in memory."""
        return list(self._bases.values())

    def load(
        self,
        key: ModelKey,
        base_model: str,
        lora: LoraSettings,
        optim: OptimSettings,
        *,
        device: str,
        checkpoint: Path | None = None,
        step: int = 0,
        dtype: torch.dtype | str | None = None,
    ) -> Policy:
        """The model ``key`` into a slot, at ``step``: restored from ``checkpoint`` (a directory
        ``Policy.save`` wrote), or a fresh adapter when None. Its previous slot, if any, is replaced;
        the least recently used models are evicted to make room first. Raises what loading raises
        (``ValueError`` for a checkpoint of another shape, before anything is evicted); a model
        that fails to load is in no slot, nor its adapter on any base."""
        self.drop(key)
        path = resolve_base_model(base_model)
        torch_device = torch.device(device)
        base_key = BaseKey(base_weights_path(path), resolve_dtype(dtype, torch_device), torch_device)
        state, seed = None, 0
        if checkpoint is not None:  # refused (another shape, no checkpoint) before anything is evicted
            state, lora = read_checkpoint(checkpoint, path, lora)
            seed = int(state["seed"])
        else:
            lora = effective_lora(path, lora)
        own_base = torch_device.type == "cuda" and warm_start_lora(path) is None and unsloth_available()
        while len(self._slots) >= self.capacity:
            self.drop(next(iter(self._slots)))
        self._free_unused(keep=None if own_base else base_key)
        if not own_base:
            self._make_room_for(base_key)
        if own_base:
            if checkpoint is None:
                policy = Policy.create(path, lora, optim, device=device, dtype=dtype)
            else:
                policy = Policy.restore(checkpoint, path, lora, optim, device=device, dtype=dtype)
            self._slots[key] = Slot(policy, step, None)
            return policy
        base = self._bases.get(base_key)
        name = adapter_name(key)
        try:
            if base is None:
                log.info("loading base model", base_model=base_key.weights, device=str(torch_device))
                base = SharedBase(base_key, load_base(path, base_key.dtype, torch_device))
                self._bases[base_key] = base
            # LoRA A is drawn from the global RNG: seeded as ``Policy.create`` seeds it, privately.
            with torch.random.fork_rng(devices=cuda_devices(torch_device)):
                torch.manual_seed(seed)
                base.model = attach_lora(base.model, name, path, lora)
            base.adapters.add(name)
            base.model.train()
            policy = Policy(
                model=base.model,
                tokenizer=base.tokenizer(tokenizer_path(path)),
                lora=lora,
                optim=optim,
                device=torch_device,
                seed=seed,
                backend="peft",
                base_model_path=path,
                adapter_name=name,
            )
            if checkpoint is not None and state is not None:  # both or neither
                policy.resume(checkpoint, state)
        except BaseException:  # no half-added adapter stays behind
            if base is not None:
                base.adapters.discard(name)
                if name in getattr(base.model, "peft_config", {}):
                    base.model.delete_adapter(name)
            self._free_unused()
            raise
        self._slots[key] = Slot(policy, step, base)
        return policy

    def drop(self, key: ModelKey) -> None:
        """The model out of memory (its adapter deleted from its base), if it is in a slot."""
        slot = self._slots.pop(key, None)
        if slot is None or slot.base is None:
            return
        self._delete_adapter(slot.base, slot.policy.adapter_name)

    def clear(self) -> None:
        for key in list(self._slots):
            self.drop(key)
        self._free_unused()

    def _delete_adapter(self, base: SharedBase, name: str) -> None:
        base.adapters.discard(name)
        # Deleted even when it is the last: a base kept for the model about to load holds no other.
        base.model.delete_adapter(name)

    def _make_room_for(self, base_key: BaseKey) -> None:
        """Evict the least recently used models of other bases until ``base_key`` fits within
        ``base_capacity`` (a base without models is freed at once)."""
        while base_key not in self._bases and len(self._bases) >= self.base_capacity:
            victim = next(k for k, slot in self._slots.items() if slot.base is not None)
            self.drop(victim)
            self._free_unused()

    def _free_unused(self, keep: BaseKey | None = None) -> None:
        """Free the bases no model uses any more, but ``keep`` (about to take a model again)."""
        unused = [k for k, base in self._bases.items() if not base.adapters and k != keep]
        for base_key in unused:
            del self._bases[base_key]
            log.info("base model freed", base_model=base_key.weights, device=str(base_key.device))
        if unused:
            gc.collect()  # a PEFT model's modules refer to each other: freed now, not someday
            if any(k.device.type == "cuda" for k in unused):
                torch.cuda.empty_cache()
            else:
                release_freed_memory()
