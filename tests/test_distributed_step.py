"""One model's GRPO step data-parallel over processes (torch.distributed, gloo): two processes
launched by torchrun give the adapter, optimizer state and metrics of the single-process step, and
so does the trainer service's step with ``world_size`` 2, loaded back into the cached policy."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from artery.schemas import Message, ModelRecord, Sample, TrainConfig, TrainRequested, Trajectory, new_event_id
from artery.services.trainer import service
from artery.services.trainer.distributed import (
    DistributedStep,
    ProcessGroupParallel,
    launch,
    train_over_processes,
)
from artery.services.trainer.policy import OptimSettings, Policy
from artery.services.trainer.settings import TrainerSettings
from artery.shared.models import TINY
from artery.shared.tiny_model import tiny_model_path

MAX_SEQ_LEN = 256
PROMPT = [{"role": "user", "content": "Say something."}]
#: Sums taken in another order (per shard, then over processes) differ in the last bits; so does
#: a prompt that the rows of a micro-batch share (passed once, ``logprobs``), since the shards'
#: micro-batches pair other rows.
ATOL = 1e-5
#: Adam's first update is about ``lr * g / |g|``: a weight whose gradient is near zero turns those
#: last bits into a visible difference (3.4e-5 at lr 1e-2, seen once). The moments, which hold
#: the gradients themselves, are compared at ``ATOL``.
WEIGHT_ATOL = 1e-4
#: The NCCL path needs one GPU per process.
CUDA_PAIR = os.environ.get("ARTERY_TEST_CUDA") == "1" and torch.cuda.device_count() >= 2

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def answer(policy: Policy, text: str, reward: float) -> Trajectory:
    """An assistant answer as the engine records it, with the logprobs the policy gives it now."""
    prompt = list(policy.tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_dict=False))
    ids = [*policy.tokenizer.encode(text, add_special_tokens=False), policy.tokenizer.eos_token_id]
    with torch.no_grad():
        inputs = torch.tensor([prompt + ids], device=policy.device)
        logits = policy.model(input_ids=inputs).logits[0, len(prompt) - 1 : -1]  # [n, V]
    picked = torch.tensor(ids, device=policy.device)[:, None]  # [n, 1]
    logprobs = torch.log_softmax(logits.float(), -1).gather(-1, picked).squeeze(-1)  # [n]
    sample = Sample(token_ids=ids, logprobs=logprobs.tolist(), finish_reason="stop")
    return Trajectory(
        messages=[
            Message(role="user", content=PROMPT[0]["content"]),
            Message(role="assistant", content=text, sample=sample),
        ],
        reward=reward,
    )


def scored_groups(policy: Policy) -> list[list[Trajectory]]:
    """Seven answers of different lengths in two groups: shards of unequal size and token count."""
    return [
        [answer(policy, "bad cafe", 1.0), answer(policy, "the water is cold tonight", 0.0)],
        [
            answer(policy, "yes", 0.2),
            answer(policy, "a big red car on the road", 0.9),
            answer(policy, "no", 0.2),
            answer(policy, "one two three four five six", 0.7),
            answer(policy, "maybe later", 0.5),
        ],
    ]


def test_distributed_shards_split_each_step_once():
    sequences = list(range(7))
    shards = [ProcessGroupParallel(rank, 3).shard(sequences) for rank in range(3)]
    assert sorted(s for shard in shards for s in shard) == sequences
    assert [len(shard) for shard in shards] == [3, 2, 2]


@pytest.mark.parametrize(
    "config",
    [
        TrainConfig(learning_rate=1e-2),  # cispo: normalised by the step's trained tokens
        # grpo: per sequence; two optimizer steps of 4 and 3 sequences; the KL term to the base
        TrainConfig(learning_rate=1e-2, loss_fn="grpo", grad_accumulation_sequences=4, kl_penalty_coef=0.1),
    ],
    ids=["cispo", "grpo-accumulated-kl"],
)
def test_distributed_gloo_step_equals_single_process(tmp_path, config):
    check_step_equality(tmp_path, config, device="cpu", atol=ATOL)


@pytest.mark.skipif(not CUDA_PAIR, reason="opt-in: ARTERY_TEST_CUDA=1 and two CUDA GPUs")
def test_distributed_nccl_step_equals_single_process(tmp_path):
    # float32 on both sides; cuBLAS's reductions are not bitwise stable, hence the looser bound.
    check_step_equality(tmp_path, TrainConfig(learning_rate=1e-2), device="cuda", atol=1e-4)


def check_step_equality(tmp_path, config: TrainConfig, *, device: str, atol: float) -> None:
    model = tiny_model_path()
    optim = OptimSettings(micro_batch_size=2)
    single = Policy.create(model, optim=optim, seed=0, device=device, dtype="float32")
    groups = scored_groups(single)
    expected = single.train_step(groups, config, max_seq_len=MAX_SEQ_LEN)
    single.save(tmp_path / "single")

    step = DistributedStep(
        base_model=str(model),
        groups=groups,
        config=config,
        max_seq_len=MAX_SEQ_LEN,
        output_dir=str(tmp_path / "parallel"),
        optim=optim,
        device=device,
        dtype="float32",
        seed=0,
        torch_threads=1,
    )
    result = launch(step, 2, spec_path=tmp_path / "step.json")

    assert expected.trained and result.trained and result.step == expected.step == 1
    assert_same_step(tmp_path / "single", tmp_path / "parallel", expected.metrics, result.metrics, atol=atol)
    if config.kl_penalty_coef:
        assert result.metrics["kl_mean"] == pytest.approx(expected.metrics["kl_mean"], abs=1e-6, rel=1e-4)


def assert_same_step(single, parallel, one_metrics: dict, two_metrics: dict, *, atol: float) -> None:
    """Two saved policies: the same adapter (moved by the step) and optimizer moments; the same
    step metrics."""
    one = load_file(single / "adapter" / "adapter_model.safetensors")
    two = load_file(parallel / "adapter" / "adapter_model.safetensors")
    assert one.keys() == two.keys()
    # LoRA B starts at zero: the step moved it, so the equality below is not that of two no-ops.
    assert max(float(one[k].abs().max()) for k in one if "lora_B" in k) > 1e-4
    for name in one:
        torch.testing.assert_close(two[name], one[name], atol=max(atol, WEIGHT_ATOL), rtol=0)
    moments_one = load_file(single / "optimizer.safetensors")
    moments_two = load_file(parallel / "optimizer.safetensors")
    assert moments_one.keys() == moments_two.keys()
    for name in moments_one:
        torch.testing.assert_close(moments_two[name], moments_one[name], atol=atol, rtol=1e-4)
    for key in ("loss", "grad_norm", "ratio_mean", "clip_fraction", "tokens_trained", "optimizer_steps"):
        assert two_metrics[key] == pytest.approx(one_metrics[key], abs=1e-5, rel=1e-4), key


async def test_distributed_service_steps_equal_the_in_process_ones(nc, database_url, tmp_path, monkeypatch):
    """The trainer's steps of two requests with world_size 1 and 2: the cached policy object is the
    one trained, in the same state either way (the service saves and publishes it as before), and
    the second step starts from the adapter and optimizer moments the first loaded back."""
    record = ModelRecord(project="dist", name="m", base_model=TINY, trainable=True)
    requests = [
        TrainRequested(
            id=new_event_id(),
            project="dist",
            model="m",
            group_ids=["g1", "g2"],
            config=TrainConfig(learning_rate=1e-2),
        )
        for _ in range(2)
    ]
    over_processes: list[int] = []  # the world size of each step that went through torchrun

    def counted(policy, groups, config, *, world_size, **kwargs):
        over_processes.append(world_size)
        return train_over_processes(policy, groups, config, world_size=world_size, **kwargs)

    monkeypatch.setattr(service, "train_over_processes", counted)
    metrics: dict[tuple[int, int], dict] = {}
    groups = None
    for world_size in (1, 2):
        settings = TrainerSettings(
            checkpoint_dir=str(tmp_path / f"ckpt{world_size}"),
            max_seq_len=MAX_SEQ_LEN,
            micro_batch_size=2,
            world_size=world_size,
            torch_threads=1,
        )
        trainer = service.Trainer(nc, database_url, settings)
        policy, start = await trainer.policies.get(record)
        assert start == 0
        groups = groups or scored_groups(policy)  # a fresh adapter of seed 0 either way
        for step, request in enumerate(requests):
            result, _ = await trainer._step(policy, step, request, record, groups)
            cached, _ = await trainer.policies.get(record)  # nothing saved: the cache's own object
            assert cached is policy and policy.step == result.step == step + 1 and result.trained
            policy.save(tmp_path / f"world{world_size}-step{step + 1}")
            metrics[world_size, step + 1] = result.metrics
        assert not list((tmp_path / f"ckpt{world_size}").rglob(".distributed-*"))  # scratch removed
    assert over_processes == [2, 2]
    assert metrics[1, 1]["optimizer_steps"] == metrics[1, 2]["optimizer_steps"] == 1.0
    first, second = ([tmp_path / f"world{world_size}-step{step}" for world_size in (1, 2)] for step in (1, 2))
    assert_same_step(*first, metrics[1, 1], metrics[2, 1], atol=ATOL)
    assert_same_step(*second, metrics[1, 2], metrics[2, 2], atol=ATOL)
