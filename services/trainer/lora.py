"""The LoRA adapter: its shape, and loading a base model with it (PEFT; Unsloth on a GPU).

On CUDA, when ``import unsloth`` works, Unsloth's ``FastLanguageModel`` loads the model and adds
the LoRA (faster kernels, less memory). That path is GPU-only and untested on the CPU machines this
was written on; everywhere else it is transformers + ``peft.get_peft_model``.
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
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )


def load_peft(path: str, lora: LoraSettings, dtype: torch.dtype, device: torch.device) -> tuple[Any, Any]:
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    # Adapter weights stay float32 on a bf16 base (PEFT's autocast_adapter_dtype): AdamW on bf16
    # LoRA weights loses small updates.
    return get_peft_model(base, peft_config(lora)), tokenizer


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
