"""The LoRA adapter: its shape, and loading a base model with it (PEFT; Unsloth on a GPU).

On CUDA, when ``import unsloth`` works, Unsloth's ``FastLanguageModel`` loads the model and adds
the LoRA (faster kernels, less memory). That path is GPU-only and untested on the CPU machines this
was written on; everywhere else it is transformers + ``peft.get_peft_model``.

A warm start (the model's ``base_model`` is a PEFT adapter directory, ``shared.models.warm_start``)
loads the adapter's base weights and the adapter itself as the trainable LoRA, always through
PEFT: step 0 is the adapter, training continues from its weights, and its shape is the model's.

``load_base`` and ``attach_lora`` are the two halves of ``load_peft``: ``slots`` loads a base once
and attaches the adapters of several models to it, each under a name of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

#: Qwen2/Llama-style projection names, plus ``lm_head``. On the tiny test model (hidden size 64,
#: tied input/output embeddings) a LoRA on attention and MLP alone barely moves the logits, and
#: the reward does not move; with ``lm_head`` it learns in a few dozen steps (ENVIRONMENT.md,
#: "Models and GRPO on the CPU"). PEFT wraps the tied ``lm_head`` Linear without untying the
#: embedding. Configurable: pass other ``target_modules`` (TRL, for one, refuses ``lm_head``).
DEFAULT_TARGET_MODULES: tuple[str, ...] = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "lm_head",
)
#: The adapter's name in a PEFT model of its own; a shared base names each model's differently.
DEFAULT_ADAPTER = "default"
#: Unsloth's ``max_seq_length`` (ART's default); only the Unsloth path uses it.
UNSLOTH_MAX_SEQ_LENGTH = 32768


@dataclass(frozen=True, kw_only=True)
class LoraSettings:
    """The adapter's shape (ART's defaults: r=8, alpha=16)."""

    rank: int = 8
    alpha: float = 16
    dropout: float = 0.0
    target_modules: tuple[str, ...] = DEFAULT_TARGET_MODULES

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_modules", tuple(self.target_modules))
        if self.rank < 1 or not self.target_modules:
            raise ValueError("LoRA needs rank >= 1 and at least one target module")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must lie in [0, 1), got {self.dropout}")


def peft_config(lora: LoraSettings) -> Any:
    from peft import LoraConfig

    return LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,  # type: ignore[arg-type]  # annotated int; PEFT divides it by r
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )


def adapter_lora_settings(config: dict) -> LoraSettings:
    """The shape of a saved PEFT LoRA adapter (its ``adapter_config.json``)."""
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"a warm start needs a LoRA adapter, not {config.get('peft_type')}")
    modules = config.get("target_modules")
    if isinstance(modules, str) or not modules:  # a regular expression: no list to compare
        raise ValueError(f"the adapter's target_modules {modules!r} is not a list of module names")
    return LoraSettings(
        rank=int(config["r"]),
        alpha=float(config.get("lora_alpha", config["r"])),
        dropout=float(config.get("lora_dropout") or 0.0),
        target_modules=tuple(sorted(modules)),
    )


def warm_start_lora(base_model: str | None) -> LoraSettings | None:
    """The LoRA shape a model's ``base_model`` imposes: the adapter's, for a warm start."""
    from artery.shared.models import warm_start

    found = warm_start(base_model) if base_model else None
    return adapter_lora_settings(found.config) if found is not None else None


def load_peft(path: str, lora: LoraSettings, dtype: torch.dtype, device: torch.device) -> tuple[Any, Any]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path(path))
    return attach_lora(load_base(path, dtype, device), DEFAULT_ADAPTER, path, lora), tokenizer


def base_weights_path(path: str) -> str:
    """Where the base weights that ``path`` trains on are: ``path`` itself, or a warm start's base."""
    from artery.shared.models import warm_start

    warm = warm_start(path)
    return warm.base_path() if warm is not None else path


def tokenizer_path(path: str) -> str:
    """The tokenizer of a model trained on ``path`` (a warm start's own when it carries one)."""
    from artery.shared.models import warm_start

    warm = warm_start(path)
    return warm.tokenizer_path() if warm is not None else path


def load_base(path: str, dtype: torch.dtype, device: torch.device) -> Any:
    """The base model ``path`` trains on, without an adapter."""
    from transformers import AutoModelForCausalLM

    # The ignore: transformers types ``to`` as functools.wraps(Module.to), whose signature mypy
    # reads unbound (a device is taken for ``self``).
    return AutoModelForCausalLM.from_pretrained(base_weights_path(path), dtype=dtype).to(device)  # type: ignore[arg-type]


def attach_lora(model: Any, name: str, path: str, lora: LoraSettings) -> Any:
    """``model`` with the trainable adapter ``name``: a fresh one of shape ``lora`` (LoRA A drawn
    from the global RNG, B = 0), or for a warm start the adapter ``path`` itself. ``model`` is a
    base model (the PEFT model made of it is returned) or a PEFT model holding other adapters
    already (``slots``: models sharing one base), which keep their weights and trainability."""
    from peft import PeftModel, get_peft_model

    from artery.shared.models import warm_start

    warm = warm_start(path)
    if isinstance(model, PeftModel):
        if warm is not None:
            device = str(next(model.parameters()).device)  # else PEFT's guess, a GPU if there is one
            model.load_adapter(
                str(warm.adapter_dir), adapter_name=name, is_trainable=True, torch_device=device
            )
        else:
            model.add_adapter(name, peft_config(lora))
        return model
    if warm is not None:
        return PeftModel.from_pretrained(model, str(warm.adapter_dir), adapter_name=name, is_trainable=True)
    # Adapter weights stay float32 on a bf16 base (PEFT's autocast_adapter_dtype): AdamW on bf16
    # LoRA weights loses small updates.
    return get_peft_model(model, peft_config(lora), adapter_name=name)


def unsloth_available() -> bool:
    """Whether ``import unsloth`` works. Only asked on CUDA: importing it patches transformers."""
    try:
        import unsloth  # noqa: F401
    except Exception:  # ImportError, or its own errors without a usable GPU
        return False
    return True


def load_unsloth(path: str, lora: LoraSettings, dtype: torch.dtype, seed: int) -> tuple[Any, Any]:
    """GPU only; untested on the CPU machines this module was written on."""
    from unsloth import FastLanguageModel

    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name=path, max_seq_length=UNSLOTH_MAX_SEQ_LENGTH, dtype=dtype, load_in_4bit=False
    )
    model = FastLanguageModel.get_peft_model(
        model,
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        bias="none",
        random_state=seed,
        use_gradient_checkpointing="unsloth",
    )
    return model, tokenizer


def effective_lora(path: str, lora: LoraSettings | None) -> LoraSettings:
    """The adapter's shape: ``lora`` (default: ``LoraSettings()``), or for a warm start the
    adapter's own, which a ``lora`` of another shape contradicts (a ``ValueError`` naming both)."""
    warm = warm_start_lora(path)
    if warm is None:
        return lora if lora is not None else LoraSettings()
    if lora is None:
        return warm
    if (lora.rank, float(lora.alpha), tuple(sorted(lora.target_modules))) != (
        warm.rank,
        warm.alpha,
        warm.target_modules,
    ):
        raise ValueError(f"{path} is an adapter of shape {warm}; asked to train it as {lora}")
    return warm
