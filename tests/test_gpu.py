"""The CUDA paths on the tiny model, opt-in: ``ARTERY_TEST_CUDA=1`` and a CUDA GPU, else skipped.

What runs here and nowhere else in the suite: the trainer's ``Policy`` on ``cuda`` in bf16 (GRPO
steps, KL against the base, checkpoints saved on the GPU and restored on the GPU and on the CPU),
and the transformers engine on ``cuda`` (sampling with token ids and logprobs, a LoRA adapter
saved by the policy, sleep/wake), then both together: the engine samples, the policy trains, the
engine hot-loads each new adapter, and the importance ratios stay at 1 (what the engine says it
sampled is what the trainer recomputes). Timings go to stdout with ``[gpu-timing]`` (run with -s)::

    ARTERY_TEST_CUDA=1 pytest tests/test_gpu.py -s

Without Unsloth installed the policy must take the plain PEFT path on ``cuda``; with it, the
Unsloth path (whose parameter dtypes are its own, so the bf16/fp32 checks apply to PEFT only).
"""

from __future__ import annotations

import asyncio
import importlib.util
import math
import os
import statistics
import time
import warnings

import pytest
import torch
from safetensors.torch import load_file

from artery.schemas import Message, Sample, TrainConfig, Trajectory
from artery.services.inference.engine.base import GenerationRequest, SamplingParams
from artery.services.inference.engine.transformers_engine import TransformersEngine
from artery.services.trainer.policy import LoraSettings, OptimSettings, Policy
from artery.shared.tiny_model import tiny_model_path
from artery.testing.tasks import half_alphabet_reward, half_alphabet_task_prompt

CUDA = os.environ.get("ARTERY_TEST_CUDA") == "1" and torch.cuda.is_available()

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not CUDA, reason="opt-in: set ARTERY_TEST_CUDA=1 on a machine with a CUDA GPU"),
]

MAX_SEQ_LEN = 256
PROMPT = [{"role": "user", "content": "Say something."}]
UNSLOTH = importlib.util.find_spec("unsloth") is not None
#: bf16 logits: the same tokens scored by a batched, cached decode and by one plain forward pass
#: differ a little in logprob; this bound has slack (on an H100, ratio_mean stayed within 1e-3 of 1).
BF16_LOGPROB_TOL = 3e-2


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT's and transformers' advice about tiny models
        yield


@pytest.fixture(scope="module")
def model_path():
    return tiny_model_path()


def timing(label: str, value: float, unit: str = "s") -> None:
    print(f"[gpu-timing] {label}: {value:.4f} {unit} ({torch.cuda.get_device_name()})")


def cuda_policy(model_path, **optim) -> Policy:
    return Policy.create(model_path, LoraSettings(), OptimSettings(**optim), device="cuda", seed=0)


def prompt_ids(tokenizer, messages=PROMPT) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))


def teacher_forced(model, prompt: list[int], token_ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    """Logprobs of ``token_ids`` after ``prompt`` from one plain forward pass, on the model's device,
    returned on the CPU as float32."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt + token_ids], device=device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()  # [n, V]
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    targets = torch.tensor(token_ids, device=device)[:, None]
    return logprobs.gather(-1, targets).squeeze(-1).cpu()


def trajectory(policy: Policy, text: str, reward: float) -> Trajectory:
    """An answer as the engine records it: token ids (stop token included) and the policy's logprobs."""
    end = policy.tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = [*policy.tokenizer.encode(text, add_special_tokens=False), end]
    logprobs = teacher_forced(policy.model, prompt_ids(policy.tokenizer), ids).tolist()
    sample = Sample(token_ids=ids, logprobs=logprobs, finish_reason="stop")
    return Trajectory(
        messages=[
            *(Message(role=m["role"], content=m["content"]) for m in PROMPT),
            Message(role="assistant", content=text, sample=sample),
        ],
        reward=reward,
    )


def scored_groups(policy: Policy) -> list[list[Trajectory]]:
    """Two groups with unequal rewards and answers of different lengths (padding in every batch)."""
    return [
        [
            trajectory(policy, "bad cafe", 1.0),
            trajectory(policy, "the water is cold tonight", 0.0),
            trajectory(policy, "hide", 0.4),
        ],
        [
            trajectory(policy, "yes", 0.2),
            trajectory(policy, "a big red car on the road", 0.9),
            trajectory(policy, "no", 0.2),
            trajectory(policy, "one two three four five six", 0.7),
        ],
    ]


def adapter_weights(policy: Policy) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in policy.named_trainable}


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].cpu() - b[k].cpu()).abs().max()) for k in a)


def optimizer_tensors(policy: Policy) -> dict[str, torch.Tensor]:
    """AdamW's state as ``"<param name>.<key>"`` tensors, moved to the CPU."""
    out = {}
    for index, (name, _) in enumerate(policy.named_trainable):
        for key, value in policy.optimizer.state_dict()["state"].get(index, {}).items():
            out[f"{name}.{key}"] = torch.as_tensor(value).detach().cpu().float().clone()
    return out


def assert_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and a
    for key in a:
        assert torch.equal(a[key].cpu(), b[key].cpu()), key


def engine_trajectory(prompt_messages, completion, reward: float) -> Trajectory:
    sample = Sample(
        token_ids=list(completion.token_ids),
        logprobs=list(completion.logprobs),
        finish_reason=completion.finish_reason,
    )
    return Trajectory(
        messages=[
            *(Message(role=m["role"], content=m["content"]) for m in prompt_messages),
            Message(role="assistant", content=completion.text, sample=sample),
        ],
        reward=reward,
    )


# --------------------------------------------------------------------------- the policy on cuda


def test_policy_on_cuda_loads_bf16_base_and_fp32_adapter(model_path):
    policy = cuda_policy(model_path)
    assert policy.device.type == "cuda"
    assert policy.backend == ("unsloth" if UNSLOTH else "peft")  # no Unsloth: the plain PEFT path
    trainable = dict(policy.named_trainable)
    assert trainable and all("lora_" in name for name in trainable)
    assert any("lm_head" in name for name in trainable)
    assert all(p.device.type == "cuda" for p in policy.model.parameters())
    if policy.backend == "peft":
        frozen = [p for p in policy.model.parameters() if not p.requires_grad]
        assert frozen and all(p.dtype == torch.bfloat16 for p in frozen)
        # AdamW on bf16 LoRA weights would lose small updates: PEFT keeps the adapter in float32.
        assert all(p.dtype == torch.float32 for p in trainable.values())
    # A fresh adapter is the base model: LoRA B starts at zero.
    assert all(float(p.abs().max()) == 0.0 for n, p in trainable.items() if "lora_B" in n)


def test_grpo_steps_on_cuda_move_logprobs_the_right_way(model_path):
    policy = cuda_policy(model_path)
    good, bad = "bad cafe", "the water is cold"
    group = [trajectory(policy, good, 1.0), trajectory(policy, bad, 0.0)]
    good_ids, bad_ids = (list(t.messages[-1].sample.token_ids) for t in group)
    prompt = prompt_ids(policy.tokenizer)
    before = (
        teacher_forced(policy.model, prompt, good_ids).sum(),
        teacher_forced(policy.model, prompt, bad_ids).sum(),
    )

    result = policy.train_step([group], TrainConfig(learning_rate=1e-2), max_seq_len=MAX_SEQ_LEN)

    after = (
        teacher_forced(policy.model, prompt, good_ids).sum(),
        teacher_forced(policy.model, prompt, bad_ids).sum(),
    )
    m = result.metrics
    assert result.trained and result.step == 1 and m["optimizer_steps"] == 1
    assert after[0] > before[0] + 0.1  # the better-rewarded answer became more likely
    assert after[1] < before[1] - 0.1  # the worse one less likely
    assert math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) and m["grad_norm"] > 0
    assert m["ratio_mean"] == pytest.approx(1.0, abs=BF16_LOGPROB_TOL)  # old logprobs are its own
    assert m["tokens_trained"] == len(good_ids) + len(bad_ids)
    weights = adapter_weights(policy)
    assert all(bool(torch.isfinite(w).all()) for w in weights.values())
    assert max(float(w.abs().max()) for n, w in weights.items() if "lora_B" in n) > 0

    # Several steps on 7 sequences in micro-batches of 8 and of 2, then the KL term (a second,
    # adapter-free forward pass): all finite; the first step pays CUDA's warm-up, the rest are timed.
    times = []
    for micro_batch_size in (8, 2):
        policy.optim = OptimSettings(micro_batch_size=micro_batch_size)
        for _ in range(4):
            step = policy.train_step(
                scored_groups(policy), TrainConfig(learning_rate=1e-3), max_seq_len=MAX_SEQ_LEN
            )
            assert step.trained and math.isfinite(step.metrics["loss"]), step.metrics
            times.append(step.metrics["step_time_s"])
        timing(
            f"train_step, 7 sequences, micro-batch {micro_batch_size} (median of last 3)",
            statistics.median(times[-3:]),
        )
    for _ in range(2):  # the first pays the adapter-free pass's warm-up
        kl = policy.train_step(
            scored_groups(policy),
            TrainConfig(learning_rate=1e-3, kl_penalty_coef=0.05),
            max_seq_len=MAX_SEQ_LEN,
        )
        assert kl.trained and math.isfinite(kl.metrics["kl_mean"]) and kl.metrics["kl_mean"] > 0
    timing("train_step with KL, 7 sequences", kl.metrics["step_time_s"])
    assert policy.step == 11


def test_checkpoint_saved_on_cuda_restores_on_cuda_and_on_cpu(model_path, tmp_path):
    config = TrainConfig(learning_rate=1e-2)
    policy = cuda_policy(model_path, micro_batch_size=3)
    first, second = scored_groups(policy), scored_groups(policy)[::-1]
    policy.train_step(first, config, max_seq_len=MAX_SEQ_LEN)
    started = time.perf_counter()
    checkpoint = policy.save(tmp_path / "ckpt")
    timing("Policy.save", time.perf_counter() - started)
    saved, saved_moments = adapter_weights(policy), optimizer_tensors(policy)
    assert any(k.endswith(".exp_avg") for k in saved_moments)
    assert "torch_cuda.0" in load_file(checkpoint / "rng.safetensors")  # the GPU's RNG state travels too

    policy.train_step(second, config, max_seq_len=MAX_SEQ_LEN)  # the run that was never interrupted
    uninterrupted = adapter_weights(policy)
    assert max_difference(uninterrupted, saved) > 1e-3

    started = time.perf_counter()
    restored = Policy.restore(
        checkpoint, model_path, LoraSettings(), OptimSettings(micro_batch_size=3), device="cuda"
    )
    timing("Policy.restore on cuda", time.perf_counter() - started)
    assert restored.device.type == "cuda" and restored.step == 1 and restored.backend == policy.backend
    assert all(p.device.type == "cuda" for _, p in restored.named_trainable)
    assert_identical(saved, adapter_weights(restored))
    assert_identical(saved_moments, optimizer_tensors(restored))
    for state in restored.optimizer.state.values():  # moments live beside their parameters
        assert state["exp_avg"].device.type == "cuda" and state["exp_avg_sq"].device.type == "cuda"
    result = restored.train_step(second, config, max_seq_len=MAX_SEQ_LEN)
    assert result.step == 2 and result.trained
    # The same step as the uninterrupted run, up to GPU float noise that Adam amplifies where a
    # gradient is ~0 (the CPU test gets < 1e-6).
    drift = max_difference(uninterrupted, adapter_weights(restored))
    print(f"[gpu-timing] restored-vs-uninterrupted max weight difference on cuda: {drift:.3g}")
    assert drift < 1e-4

    on_cpu = Policy.restore(
        checkpoint, model_path, LoraSettings(), OptimSettings(micro_batch_size=3), device="cpu"
    )
    assert on_cpu.device.type == "cpu" and on_cpu.step == 1
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in on_cpu.model.parameters())
    assert_identical(saved, adapter_weights(on_cpu))
    assert_identical(saved_moments, optimizer_tensors(on_cpu))
    before = adapter_weights(on_cpu)
    result = on_cpu.train_step(second, config, max_seq_len=MAX_SEQ_LEN)
    assert result.trained and result.step == 2 and math.isfinite(result.metrics["loss"])
    assert max_difference(before, adapter_weights(on_cpu)) > 1e-3
    # fp32 on the CPU and bf16 on the GPU take about the same step from the same state.
    assert max_difference(uninterrupted, adapter_weights(on_cpu)) < 2e-2


# --------------------------------------------------------------------------- the engine on cuda


async def test_engine_on_cuda_samples_token_ids_and_logprobs(model_path):
    engine = TransformersEngine(model_path, device="cuda")
    await engine.start()
    try:
        model = engine._lora.model
        assert all(p.device.type == "cuda" and p.dtype == torch.bfloat16 for p in model.parameters())
        prompt = prompt_ids(engine.tokenizer)
        params = SamplingParams(max_tokens=16, temperature=1.0, n=4, seed=11, logprobs=True, top_logprobs=3)
        completions = await engine.generate(GenerationRequest(prompt, params))
        vocab = model.config.vocab_size
        assert [c.index for c in completions] == [0, 1, 2, 3]
        assert len({tuple(c.token_ids) for c in completions}) == 4
        for c in completions:
            assert 1 <= len(c.token_ids) == len(c.logprobs) == len(c.top_logprobs) <= 16
            assert all(0 <= t < vocab for t in c.token_ids)
            assert all(math.isfinite(lp) and lp <= 0 for lp in c.logprobs)
            for token, logprob, tops in zip(c.token_ids, c.logprobs, c.top_logprobs, strict=True):
                assert len(tops) == 3
                values = [v for _, v in tops]
                assert values == sorted(values, reverse=True) and logprob <= values[0] + 1e-6
                if token in dict(tops):
                    assert dict(tops)[token] == pytest.approx(logprob, abs=1e-6)
            # The logprobs are the model's: one plain forward pass over the same tokens agrees.
            served = torch.tensor(c.logprobs)
            assert torch.allclose(teacher_forced(model, prompt, c.token_ids), served, atol=BF16_LOGPROB_TOL)
        again = await engine.generate(GenerationRequest(prompt, params))
        assert [c.token_ids for c in again] == [c.token_ids for c in completions]  # seeded: reproducible
        greedy = SamplingParams(max_tokens=16, temperature=0)
        one, two = await asyncio.gather(
            engine.generate(GenerationRequest(prompt, greedy)),
            engine.generate(GenerationRequest(prompt, greedy)),
        )
        assert one[0].token_ids == two[0].token_ids

        # Decode speed: 16 rows x 64 tokens, the second of two such batches.
        params = SamplingParams(max_tokens=64, temperature=1.0, n=16, seed=1)
        for _ in range(2):
            started = time.perf_counter()
            batch = await engine.generate(GenerationRequest(prompt, params))
            elapsed = time.perf_counter() - started
        tokens = sum(len(c.token_ids) for c in batch)
        timing(f"engine generate, n=16 x <=64 tokens ({tokens} tokens)", elapsed)
        timing("engine decode throughput", tokens / elapsed, "tokens/s")
    finally:
        await engine.close()


async def test_engine_on_cuda_serves_a_policy_adapter_and_sleeps(model_path, tmp_path):
    policy = cuda_policy(model_path)
    for _ in range(3):
        policy.train_step(scored_groups(policy), TrainConfig(learning_rate=1e-2), max_seq_len=MAX_SEQ_LEN)
    adapter = policy.adapter_dir(policy.save(tmp_path / "ckpt"))
    policy.model.eval()

    engine = TransformersEngine(model_path, device="cuda")
    await engine.start()
    try:
        started = time.perf_counter()
        await engine.load_adapter("tiny@1", adapter)
        timing("engine load_adapter on cuda", time.perf_counter() - started)
        assert all(p.device.type == "cuda" for p in engine._lora.model.parameters())
        prompt = prompt_ids(engine.tokenizer)
        sampled = SamplingParams(max_tokens=8, temperature=1.0, logprobs=True, seed=7)
        (tuned,) = await engine.generate(GenerationRequest(prompt, sampled, adapter="tiny@1"))
        (base,) = await engine.generate(GenerationRequest(prompt, sampled))
        served = torch.tensor(tuned.logprobs)
        # What the engine served under the adapter is what the policy computes for those tokens...
        assert torch.allclose(
            teacher_forced(policy.model, prompt, tuned.token_ids), served, atol=BF16_LOGPROB_TOL
        )
        with policy.model.disable_adapter():  # ...and not what the base model says
            base_view = teacher_forced(policy.model, prompt, tuned.token_ids)
        assert float((base_view - served).abs().max()) > 5 * BF16_LOGPROB_TOL
        assert base.token_ids and all(math.isfinite(lp) for lp in base.logprobs)

        greedy = SamplingParams(max_tokens=16, temperature=0)
        (greedy_tuned,) = await engine.generate(GenerationRequest(prompt, greedy, adapter="tiny@1"))
        (greedy_base,) = await engine.generate(GenerationRequest(prompt, greedy))

        allocated = torch.cuda.memory_allocated()
        started = time.perf_counter()
        assert await engine.sleep() is True
        timing("engine sleep (to the CPU)", time.perf_counter() - started)
        assert all(p.device.type == "cpu" for p in engine._lora.model.parameters())
        assert torch.cuda.memory_allocated() < allocated  # the policy's own memory stays
        pending = asyncio.create_task(engine.generate(GenerationRequest(prompt, greedy, adapter="tiny@1")))
        await asyncio.sleep(0.1)
        assert not pending.done()  # requests wait while the engine sleeps
        await engine.load_adapter("tiny@2", adapter)  # an adapter arriving while asleep wakes up with it
        started = time.perf_counter()
        await engine.wake()
        timing("engine wake (back to cuda)", time.perf_counter() - started)
        assert all(p.device.type == "cuda" for p in engine._lora.model.parameters())
        assert (await pending)[0].token_ids == greedy_tuned.token_ids
        (after_base,) = await engine.generate(GenerationRequest(prompt, greedy))
        (after_two,) = await engine.generate(GenerationRequest(prompt, greedy, adapter="tiny@2"))
        assert after_base.token_ids == greedy_base.token_ids
        assert after_two.token_ids == greedy_tuned.token_ids

        assert await engine.sleep() is True and await engine.sleep() is False  # already asleep
        await engine.wake()
        (again,) = await engine.generate(GenerationRequest(prompt, sampled, adapter="tiny@1"))
        assert again.token_ids == tuned.token_ids  # seeded sampling survives two round trips
        assert torch.allclose(torch.tensor(again.logprobs), served, atol=1e-6)
    finally:
        await engine.close()


# --------------------------------------------------------------------------- both, in a loop


async def test_engine_samples_policy_trains_adapter_hot_loads(model_path, tmp_path):
    """The half-alphabet task on the GPU: the engine samples (2 groups x 8, <= 8 tokens), the policy
    trains on exactly those tokens and logprobs, each new adapter is hot-loaded into the engine."""
    policy = cuda_policy(model_path, micro_batch_size=16)
    engine = TransformersEngine(model_path, device="cuda")
    await engine.start()
    messages = half_alphabet_task_prompt()
    prompt = prompt_ids(engine.tokenizer, messages)
    config = TrainConfig(learning_rate=1e-2, loss_fn="cispo")
    curve, ratios, train_times, sample_times = [], [], [], []
    adapter = None
    try:
        for step in range(60):
            params = SamplingParams(max_tokens=8, temperature=1.0, n=8, logprobs=True, seed=1000 + step)
            started = time.perf_counter()
            sampled = await asyncio.gather(
                *(
                    engine.generate(
                        GenerationRequest(prompt, params, adapter=adapter, request_id=f"{step}.{g}")
                    )
                    for g in range(2)
                )
            )
            sample_times.append(time.perf_counter() - started)
            groups = [
                [engine_trajectory(messages, c, half_alphabet_reward(c.text)) for c in completions]
                for completions in sampled
            ]
            result = policy.train_step(groups, config, max_seq_len=MAX_SEQ_LEN)
            curve.append(round(result.metrics["reward_mean"], 3))
            if not result.trained:
                continue
            train_times.append(result.metrics["step_time_s"])
            ratios.append(result.metrics["ratio_mean"])
            if curve[-1] >= 0.8:
                break
            name = f"tiny@{result.step}"
            await engine.load_adapter(name, policy.adapter_dir(policy.save(tmp_path / name)))
            if adapter is not None:
                await engine.unload_adapter(adapter)
            adapter = name
    finally:
        await engine.close()
    print("[gpu-timing] half-alphabet reward by step:", curve)
    print("[gpu-timing] ratio_mean by step:", [round(r, 4) for r in ratios])
    timing("loop: engine sampling of 2 groups x 8 (median)", statistics.median(sample_times))
    timing("loop: train_step on 16 sequences (median)", statistics.median(train_times))
    # On-policy at every step: the engine's logprobs (bf16 base, fp32 adapter) are the trainer's.
    assert ratios and all(abs(r - 1.0) < BF16_LOGPROB_TOL for r in ratios), ratios
    assert curve[0] < 0.6
    assert curve[-1] >= 0.8, curve
