"""The default size of vLLM-CPU's KV cache: the served model's contexts, within the cap, never
less than one whole context (vLLM would refuse to start). The engine's use of it on a real
vLLM-CPU config is in ``test_engine_vllm.py``."""

from __future__ import annotations

from artery.services.inference.engine.vllm_cpu_kv_cache import CAP_BYTES, CONTEXTS, MIB, kv_cache_bytes

#: SmolLM2-135M in bfloat16: 30 layers, 3 KV heads of 64, 8,192 tokens of context.
SMOLLM2_BF16 = dict(layers=30, kv_heads=3, head_size=64, dtype_bytes=2, max_model_len=8192)


def test_a_small_model_gets_its_contexts_and_no_more():
    per_token = 2 * 30 * 3 * 64 * 2
    assert kv_cache_bytes(**SMOLLM2_BF16) == CONTEXTS * 8192 * per_token
    assert kv_cache_bytes(**SMOLLM2_BF16) == 720 * MIB
    assert kv_cache_bytes(**{**SMOLLM2_BF16, "max_model_len": 1024}) == 90 * MIB


def test_float32_takes_twice_bfloat16s():
    assert kv_cache_bytes(**{**SMOLLM2_BF16, "dtype_bytes": 4}) == 2 * kv_cache_bytes(**SMOLLM2_BF16)


def test_the_cap_holds_when_one_context_fits_under_it():
    # Qwen3-0.6B-like: 28 layers, 8 KV heads of 128, 16k tokens: 1.75 GiB a context.
    shape = dict(layers=28, kv_heads=8, head_size=128, dtype_bytes=2, max_model_len=16_384)
    assert kv_cache_bytes(**shape) == CAP_BYTES


def test_one_context_is_the_floor_even_above_the_cap():
    # The same at 40,960 tokens: one context is 4.4 GiB, which vLLM needs to start at all.
    shape = dict(layers=28, kv_heads=8, head_size=128, dtype_bytes=2, max_model_len=40_960)
    one_context = 2 * 28 * 8 * 128 * 2 * 40_960
    assert kv_cache_bytes(**shape) == one_context > CAP_BYTES


def test_sizes_are_whole_mebibytes():
    size = kv_cache_bytes(layers=1, kv_heads=1, head_size=1, dtype_bytes=2, max_model_len=3)
    assert size == MIB
