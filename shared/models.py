"""Where a base model's weights come from.

A ``base_model`` is a local directory, one of the embedded names below (built or unpacked once
into the cache, since these machines reach no model hub), or a Hugging Face name that must
already be in the local Hugging Face cache.
"""

from __future__ import annotations

from pathlib import Path

#: A tiny random Qwen2 with a locally trained tokenizer: for tests and benchmarks.
TINY = "artery/tiny-random"


def resolve_base_model(name: str) -> str:
    """A path (or cached hub name) that ``from_pretrained`` can load without a network."""
    if Path(name).expanduser().is_dir():
        return str(Path(name).expanduser())
    if name == TINY:
        from artery.testing.tiny_model import tiny_model_path

        return str(tiny_model_path())
    return name


def limit_torch_threads(threads: int) -> None:
    """Cap torch's CPU threads (0 leaves torch's default). On a small machine shared by the
    trainer and replicas, every process using every core makes each of them slower."""
    if threads > 0:
        import torch

        torch.set_num_threads(threads)
