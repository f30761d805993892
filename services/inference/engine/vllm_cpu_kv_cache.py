"""The size of vLLM-CPU's KV cache when nobody gives one: the served model's own need.

On the CPU vLLM takes the KV cache's size from ``VLLM_CPU_KVCACHE_SPACE`` (whole GiB) or
``kv_cache_memory_bytes`` and allocates all of it before the replica says ready. Allocating it is
not free: every GiB costs its start seconds on a small machine (docs/results), paid by every
replica's start, so the demo's and every test's. A fixed 2 GiB held ~11 full contexts of
SmolLM2 and was mostly never touched. The default here holds ``CONTEXTS`` full contexts of the
served model (a request as long as the model allows, or many short ones: a group of rollouts
and a held-out evaluation at once; a longer queue waits its turn, as on a GPU whose cache is
full), and never more than ``CAP_BYTES`` unless one context alone needs more: vLLM refuses to
start a model whose longest request would not fit.
"""

from __future__ import annotations

from typing import Any

#: Full-length contexts the default KV cache holds.
CONTEXTS = 4
#: The most the default takes when one context fits in less (the former fixed size).
CAP_BYTES = 2 << 30
MIB = 1 << 20


def kv_cache_bytes(
    *, layers: int, kv_heads: int, head_size: int, dtype_bytes: int, max_model_len: int
) -> int:
    """Bytes of KV cache for ``CONTEXTS`` contexts of ``max_model_len`` tokens (a key and a value
    of ``kv_heads`` × ``head_size`` per layer and token), at most ``CAP_BYTES`` unless a single
    context needs more, rounded up to whole MiB."""
    per_token = 2 * layers * kv_heads * head_size * dtype_bytes
    one_context = per_token * max_model_len
    wanted = max(min(CONTEXTS * one_context, CAP_BYTES), one_context)
    return -(-wanted // MIB) * MIB


def for_config(vllm_config: Any) -> int:
    """``kv_cache_bytes`` for a vLLM ``VllmConfig``: its model's layers, KV heads and head size
    as vLLM counts them, in the cache's dtype (the model's unless ``kv_cache_dtype`` is given)."""
    import torch

    model, parallel, cache = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    dtype = model.dtype if cache.cache_dtype in (None, "auto") else _cache_dtype(cache.cache_dtype)
    return kv_cache_bytes(
        layers=model.get_num_layers(parallel),
        kv_heads=model.get_num_kv_heads(parallel),
        head_size=model.get_head_size(),
        dtype_bytes=torch.empty(0, dtype=dtype).element_size(),
        max_model_len=model.max_model_len,
    )


def _cache_dtype(name: str) -> Any:
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE

    return STR_DTYPE_TO_TORCH_DTYPE[name]
