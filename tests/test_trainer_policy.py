"""The trainer's in-process core on the tiny model: one GRPO step, skipped groups, micro-batching,
checkpoints that resume exactly, adapters that inference loads, and a task that is learned."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from artery.schemas import Message, Sample, TrainConfig, TrainSFTConfig, Trajectory
from artery.services.inference.engine.base import GenerationRequest, SamplingParams
from artery.services.inference.engine.transformers_engine import TransformersEngine
from artery.services.trainer import logprobs as logprobs_module
from artery.services.trainer import policy as policy_module
from artery.services.trainer.memory import IdleHeapRelease
from artery.services.trainer.policy import (
    LoraSettings,
    OptimSettings,
    Policy,
    flatten_optimizer_state,
    next_token_logprobs,
    plan_groups,
    token_logprobs,
    unflatten_optimizer_state,
)
from artery.services.trainer.sequences import build_sequences, pad_batch
from artery.shared.tiny_model import tiny_model_path
from artery.testing.tasks import half_alphabet_groups

MAX_SEQ_LEN = 256
PROMPT = [{"role": "user", "content": "Say something."}]

pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.fixture(scope="module")
def model_path():
    return tiny_model_path()


def make_policy(model_path, **optim) -> Policy:
    return Policy.create(model_path, LoraSettings(), OptimSettings(**optim), seed=0)


def prompt_ids(policy: Policy, messages=PROMPT) -> list[int]:
    return list(policy.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))


def completion_logprobs(policy: Policy, token_ids: list[int], messages=PROMPT) -> torch.Tensor:
    """Teacher-forced logprobs of ``token_ids`` after the prompt, under the policy as it is now."""
    prompt = prompt_ids(policy, messages)
    ids = torch.tensor([prompt + token_ids])
    with torch.no_grad():
        logits = policy.model(input_ids=ids).logits[0, len(prompt) - 1 : -1]  # [n, V]
    return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(token_ids)[:, None]).squeeze(-1)


def trajectory(policy: Policy, text: str, reward: float, messages=PROMPT) -> Trajectory:
    """An assistant answer as the engine records it: exact token ids (stop token included) and
    the logprobs the current policy gives them."""
    end = policy.tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = [*policy.tokenizer.encode(text, add_special_tokens=False), end]
    logprobs = completion_logprobs(policy, ids, messages).tolist()
    sample = Sample(token_ids=ids, logprobs=logprobs, finish_reason="stop")
    return Trajectory(
        messages=[
            *(Message(role=m["role"], content=m["content"]) for m in messages),
            Message(role="assistant", content=text, sample=sample),
        ],
        reward=reward,
    )


def adapter_weights(policy: Policy) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in policy.named_trainable}


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def scored_groups(policy: Policy) -> list[list[Trajectory]]:
    """Two groups with unequal rewards and answers of different lengths (so that normalising per
    sequence, per token or per micro-batch would give different gradients)."""
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


# --------------------------------------------------------------------------- one step


def test_step_raises_the_better_completion(model_path):
    policy = make_policy(model_path)
    good, bad = "bad cafe", "the water is cold"
    group = [trajectory(policy, good, 1.0), trajectory(policy, bad, 0.0)]
    good_ids, bad_ids = (list(t.messages[-1].sample.token_ids) for t in group)
    before = completion_logprobs(policy, good_ids).sum(), completion_logprobs(policy, bad_ids).sum()

    result = policy.train_step([group], TrainConfig(learning_rate=1e-2), max_seq_len=MAX_SEQ_LEN)

    after = completion_logprobs(policy, good_ids).sum(), completion_logprobs(policy, bad_ids).sum()
    assert result.trained and result.skip_reason is None and result.step == 1
    assert after[0] > before[0] + 0.1  # the better-rewarded answer became more likely
    assert after[1] < before[1] - 0.1  # the worse one less likely
    m = result.metrics
    assert all(isinstance(v, float) for v in m.values())
    assert m["groups"] == 1 and m["groups_trained"] == 1 and m["groups_skipped_equal_rewards"] == 0
    assert m["sequences"] == 2 and m["sequences_dropped"] == 0 and m["sequences_cut"] == 0
    assert m["tokens_trained"] == len(good_ids) + len(bad_ids)
    assert m["reward_mean"] == 0.5 and m["reward_std"] == 0.5
    assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-4)  # old logprobs are the policy's own
    assert m["grad_norm"] > 0 and m["optimizer_steps"] == 1 and m["step_time_s"] > 0 and m["trained"] == 1
    assert "kl_mean" not in m


def test_a_cpu_step_leaves_its_freed_heap_to_the_idle_release(model_path, monkeypatch):
    """The step's activations are not handed back to the OS when it ends (the next step would fault
    them back in) but once the trainer has been idle (``memory.IdleHeapRelease``); SFT likewise."""
    released: list[int] = []
    heap = IdleHeapRelease(idle_s=3600.0, release=lambda: released.append(1))
    monkeypatch.setattr(policy_module, "freed_heap", heap)
    policy = make_policy(model_path)
    group = [trajectory(policy, "bad cafe", 1.0), trajectory(policy, "the water is cold", 0.0)]
    assert not heap.pending()
    assert policy.train_step([group], TrainConfig(learning_rate=1e-3), max_seq_len=MAX_SEQ_LEN).trained
    assert heap.pending() and not released
    heap.busy()
    assert policy.sft_step([group[0]], TrainSFTConfig(learning_rate=1e-3), max_seq_len=MAX_SEQ_LEN).trained
    assert heap.pending() and not released
    heap.busy()


def test_equal_reward_groups_are_skipped_and_counted(model_path):
    policy = make_policy(model_path)
    groups = [
        [trajectory(policy, "bad cafe", 0.5), trajectory(policy, "hide", 0.5)],
        [trajectory(policy, "yes", 1.0), trajectory(policy, "no", 1.0), trajectory(policy, "ok", 1.0)],
    ]
    before = adapter_weights(policy)

    result = policy.train_step(groups, TrainConfig(learning_rate=1e-2), max_seq_len=MAX_SEQ_LEN)

    assert not result.trained and result.skip_reason == "all_groups_skipped"
    assert result.step == 1  # the policy version advances anyway, as ART's
    m = result.metrics
    assert m["groups_skipped_equal_rewards"] == 2 and m["groups_trained"] == 0
    assert m["sequences"] == 0 and m["tokens_trained"] == 0 and m["dropped/zero_advantage"] == 5
    assert "loss" not in m and "grad_norm" not in m and m["trained"] == 0
    assert max_difference(before, adapter_weights(policy)) == 0.0
    assert not policy.optimizer.state  # no optimizer step: no moments either


def test_mixed_groups_skip_only_the_equal_ones(model_path):
    policy = make_policy(model_path)
    groups = [
        [trajectory(policy, "bad", 0.3), trajectory(policy, "cafe", 0.3)],
        [trajectory(policy, "hide", 1.0), trajectory(policy, "no", 0.0)],
        [trajectory(policy, "alone", 1.0)],
    ]
    result = policy.train_step(groups, TrainConfig(learning_rate=1e-3), max_seq_len=MAX_SEQ_LEN)
    m = result.metrics
    assert result.trained
    assert (m["groups"], m["groups_trained"]) == (3, 1)
    assert (m["groups_skipped_equal_rewards"], m["groups_skipped_too_small"]) == (1, 1)
    assert m["sequences"] == 2


def test_nothing_trainable_is_reported(model_path):
    policy = make_policy(model_path)
    no_sample = [
        Trajectory(
            messages=[Message(role="user", content="hi"), Message(role="assistant", content=t)], reward=r
        )
        for t, r in (("a", 0.0), ("b", 1.0))
    ]
    result = policy.train_step([no_sample], TrainConfig(), max_seq_len=MAX_SEQ_LEN)
    assert not result.trained and result.skip_reason == "no_trainable_sequences"
    assert result.metrics["sequences_dropped"] == 2 and result.metrics["dropped/no_trainable_message"] == 2

    empty = policy.train_step([], TrainConfig(), max_seq_len=MAX_SEQ_LEN)
    assert not empty.trained and empty.skip_reason == "no_groups" and empty.step == 2


def test_plan_groups_by_hand():
    t = lambda r: Trajectory(messages=[Message(role="user", content="x")], reward=r)  # noqa: E731
    # group 1: mean 0.5, population std 0.5 -> advantages ±1 (scaled); group 2: equal
    plan = plan_groups([[t(1.0), t(0.0)], [t(0.2), t(0.2)]], scale_rewards=True)
    assert plan.advantages[0] == pytest.approx([1.0, -1.0], abs=1e-5)
    assert plan.advantages[1] == [0.0, 0.0]
    assert plan.metrics["reward_mean"] == pytest.approx(0.35)
    assert plan.metrics["reward_std"] == pytest.approx(0.25)  # (0.5 + 0) / 2
    with pytest.raises(ValueError, match="finite"):
        plan_groups([[t(float("nan")), t(1.0)]], scale_rewards=True)


# --------------------------------------------------------------------------- logprobs


def autograd_token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """The formula ``token_logprobs`` computes, as autograd would: [B,T,V], [B,T] -> [B,T]."""
    scaled = logits.float() / temperature  # [B,T,V]
    return scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(scaled, dim=-1)  # [B,T]


@pytest.mark.parametrize("chunk_elements", [1, 2 * 3 * 50, 1 << 22])  # a position, two, all at once
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_equal_the_autograd_formula(monkeypatch, chunk_elements, temperature):
    monkeypatch.setattr(logprobs_module, "LOGPROB_CHUNK_ELEMENTS", chunk_elements)
    generator = torch.Generator().manual_seed(0)
    logits = (4 * torch.randn(3, 7, 50, generator=generator)).requires_grad_()  # [B,T,V]
    targets = torch.randint(0, 50, (3, 7), generator=generator)  # [B,T]
    upstream = torch.randn(3, 7, generator=generator)  # [B,T] a loss's gradient

    reference = autograd_token_logprobs(logits, targets, temperature)
    (reference_grad,) = torch.autograd.grad((reference * upstream).sum(), logits)
    chunked = token_logprobs(logits, targets, temperature)
    (chunked_grad,) = torch.autograd.grad((chunked * upstream).sum(), logits)

    torch.testing.assert_close(chunked, reference, rtol=0, atol=1e-5)
    torch.testing.assert_close(chunked_grad, reference_grad, rtol=0, atol=1e-5)


def test_bf16_logits_get_the_gradient_autograd_gives_them():
    """The GPU path: bf16 logits, float32 logprobs, and a bf16 gradient, as ``.float()``'s backward."""
    generator = torch.Generator().manual_seed(1)
    logits = (4 * torch.randn(2, 6, 40, generator=generator)).bfloat16().requires_grad_()  # [B,T,V]
    targets = torch.randint(0, 40, (2, 6), generator=generator)  # [B,T]
    upstream = torch.randn(2, 6, generator=generator)  # [B,T]

    reference = autograd_token_logprobs(logits, targets, 0.7)
    (reference_grad,) = torch.autograd.grad((reference * upstream).sum(), logits)
    chunked = token_logprobs(logits, targets, 0.7)
    (chunked_grad,) = torch.autograd.grad((chunked * upstream).sum(), logits)

    assert chunked.dtype == torch.float32 and chunked_grad.dtype == torch.bfloat16
    torch.testing.assert_close(chunked, reference, rtol=0, atol=1e-5)
    torch.testing.assert_close(chunked_grad, reference_grad)


def test_token_logprobs_keep_no_copy_of_the_logits_for_backward():
    logits = torch.randn(2, 5, 64, requires_grad=True)  # [B,T,V]
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        token_logprobs(logits, torch.zeros(2, 5, dtype=torch.long), 1.0)
    full = [t for t in saved if t.numel() >= logits.numel()]
    assert [t.untyped_storage().data_ptr() for t in full] == [logits.untyped_storage().data_ptr()]
    assert sum(t.numel() for t in saved) == logits.numel() + 2 * 2 * 5  # + targets and logsumexp


def padded_batch(policy: Policy) -> dict[str, torch.Tensor]:
    groups = scored_groups(policy)
    plan = plan_groups(groups, scale_rewards=True)
    sequences, _ = build_sequences(groups, plan.advantages, policy.tokenizer, max_seq_len=MAX_SEQ_LEN)
    return pad_batch(sequences, policy.pad_id)


def test_next_token_logprobs_equal_those_of_the_full_logits(model_path):
    """Logits only from the first trained position on: the same logprobs where tokens are trained,
    and the same adapter gradient, as the whole sequence's logits through the autograd formula."""
    policy = make_policy(model_path)
    batch = padded_batch(policy)
    mask = batch["assistant_mask"]  # [B,T-1]
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(0)) * mask  # [B,T-1]
    input_ids = batch["input_ids"]  # [B,T]
    # Move the adapter off its zero start (LoRA B = 0), so that every adapter weight gets a gradient.
    policy.train_step(scored_groups(policy), TrainConfig(learning_rate=1e-2), max_seq_len=MAX_SEQ_LEN)

    logits = policy.model(input_ids=input_ids, attention_mask=batch["attention_mask"]).logits  # [B,T,V]
    full = autograd_token_logprobs(logits[:, :-1], input_ids[:, 1:], 0.8)  # [B,T-1]
    full_grads = torch.autograd.grad((full * weights).sum(), [p for _, p in policy.named_trainable])
    kept = next_token_logprobs(policy.model, batch, 0.8)  # [B,T-1]
    kept_grads = torch.autograd.grad((kept * weights).sum(), [p for _, p in policy.named_trainable])

    start = int(mask.any(0).nonzero()[0, 0])
    assert start > 5  # the prompt's positions were left out
    assert torch.equal(kept[:, :start], torch.zeros_like(kept[:, :start]))
    torch.testing.assert_close(kept * mask, full * mask, rtol=0, atol=1e-5)
    for kept_grad, full_grad in zip(kept_grads, full_grads, strict=True):
        torch.testing.assert_close(kept_grad, full_grad, rtol=1e-4, atol=1e-6)
    assert max(float(g.abs().max()) for g in full_grads) > 1e-3


class PassRecorder:
    """The policy's model, recording the shape of the ``input_ids`` of each pass it is given."""

    def __init__(self, model) -> None:
        self.model, self.passes = model, []

    def __call__(self, **inputs):
        self.passes.append(tuple(inputs["input_ids"].shape))
        return self.model(**inputs)

    def __getattr__(self, name):
        return getattr(self.model, name)


def test_a_prompt_every_row_shares_is_passed_once(model_path):
    """The rows' common prompt goes through the model once and the rows continue from its cache:
    the same logprobs and adapter gradient as the rows passed whole."""
    policy = make_policy(model_path)
    policy.train_step(scored_groups(policy), TrainConfig(learning_rate=1e-2), max_seq_len=MAX_SEQ_LEN)
    batch = padded_batch(policy)
    rows, length = batch["input_ids"].shape
    mask = batch["assistant_mask"]  # [B,T-1]
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1)) * mask  # [B,T-1]
    params = [p for _, p in policy.named_trainable]

    shared_model = PassRecorder(policy.model)
    shared = next_token_logprobs(shared_model, batch, 0.8)  # [B,T-1]
    shared_grads = torch.autograd.grad((shared * weights).sum(), params)
    whole_model = PassRecorder(policy.model)
    whole = next_token_logprobs_of_whole_rows(whole_model, batch, 0.8)  # [B,T-1]
    whole_grads = torch.autograd.grad((whole * weights).sum(), params)

    prefix = logprobs_module.shared_prefix_length(batch)
    assert prefix >= logprobs_module.MIN_SHARED_PREFIX  # the chat template's prompt, up to the answers
    assert shared_model.passes == [(1, prefix), (rows, length - prefix)]
    assert whole_model.passes == [(rows, length)]
    torch.testing.assert_close(shared * mask, whole * mask, rtol=0, atol=1e-5)
    for shared_grad, whole_grad in zip(shared_grads, whole_grads, strict=True):
        torch.testing.assert_close(shared_grad, whole_grad, rtol=1e-4, atol=1e-6)
    assert max(float(g.abs().max()) for g in whole_grads) > 1e-3


def next_token_logprobs_of_whole_rows(model, batch, temperature):
    original = logprobs_module.MIN_SHARED_PREFIX
    logprobs_module.MIN_SHARED_PREFIX = 1 << 30  # no prefix is long enough: every row passed whole
    try:
        return next_token_logprobs(model, batch, temperature)
    finally:
        logprobs_module.MIN_SHARED_PREFIX = original


def test_the_shared_prefix_stops_where_rows_differ_pad_or_train():
    def batch(rows: list[list[int]], trained_from: int) -> dict[str, torch.Tensor]:
        length = max(len(r) for r in rows)
        ids = torch.tensor([r + [0] * (length - len(r)) for r in rows])  # [B,T]
        attention = torch.tensor([[1] * len(r) + [0] * (length - len(r)) for r in rows])  # [B,T]
        trained = torch.zeros(len(rows), length - 1)  # [B,T-1]
        trained[:, trained_from:] = 1
        return {"input_ids": ids, "attention_mask": attention, "assistant_mask": trained}

    shared_prefix_length = logprobs_module.shared_prefix_length
    assert shared_prefix_length(batch([[5, 6, 7, 8, 9], [5, 6, 7, 1, 2]], trained_from=3)) == 3
    assert shared_prefix_length(batch([[5, 6, 7, 8, 9], [5, 6, 7, 8, 9]], trained_from=2)) == 2
    assert shared_prefix_length(batch([[5, 6, 7], [5, 6, 7, 8, 9]], trained_from=3)) == 3  # padding differs
    assert shared_prefix_length(batch([[1, 6, 7], [5, 6, 7]], trained_from=1)) == 0
    assert shared_prefix_length(batch([[5, 6, 7, 8, 9]], trained_from=3)) == 0  # one row: nothing to share


# --------------------------------------------------------------------------- micro-batching


def record_gradients(policy: Policy) -> dict[str, torch.Tensor]:
    """The accumulated gradient of each adapter weight at the end of backward, before clipping."""
    grads: dict[str, torch.Tensor] = {}
    for name, param in policy.named_trainable:
        param.register_post_accumulate_grad_hook(lambda p, name=name: grads.__setitem__(name, p.grad.clone()))
    return grads


@pytest.mark.parametrize(
    ("loss_fn", "kl"), [("grpo", 0.0), ("dapo", 0.0), ("cispo", 0.0), ("dr_grpo", 0.0), ("grpo", 0.05)]
)
def test_micro_batches_give_the_same_update(model_path, loss_fn, kl):
    config = TrainConfig(learning_rate=1e-2, loss_fn=loss_fn, kl_penalty_coef=kl)
    metrics, grads, weights = [], [], []
    for micro_batch_size in (1, 64):  # 7 sequences of different lengths: one each, or all at once
        policy = make_policy(model_path, micro_batch_size=micro_batch_size)
        groups = scored_groups(policy)
        if kl:  # move the adapter off the base model first, so that the KL term has a gradient
            policy.train_step(groups, TrainConfig(learning_rate=1e-2), max_seq_len=MAX_SEQ_LEN)
        grads.append(record_gradients(policy))
        metrics.append(policy.train_step(groups, config, max_seq_len=MAX_SEQ_LEN).metrics)
        weights.append(adapter_weights(policy))
    one, many = metrics
    for key in ("loss", "grad_norm", "ratio_mean", "clip_fraction", "tokens_trained", "sequences"):
        assert one[key] == pytest.approx(many[key], rel=1e-5, abs=1e-7), key
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == len(policy.named_trainable)
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-5, atol=1e-7)
    # Adam divides by sqrt(v): its first update is about lr * g / |g|, so a weight whose gradient
    # is ~0 turns the gradients' float noise (checked at 1e-5 above) into up to lr of difference.
    # How much depends on the CPU's matmul kernels: 1.1-1.4e-5 on an AVX2 machine where AVX-512
    # gave under 1e-5. The weights are checked at 1% of the learning rate.
    assert max_difference(*weights) < 1e-4
    if kl:
        assert one["kl_mean"] > 0 and one["kl_mean"] == pytest.approx(many["kl_mean"], rel=1e-5)


def test_grad_accumulation_sequences_splits_the_step(model_path):
    policy = make_policy(model_path, micro_batch_size=2)
    groups = scored_groups(policy)
    config = TrainConfig(learning_rate=1e-3, grad_accumulation_sequences=3)
    result = policy.train_step(groups, config, max_seq_len=MAX_SEQ_LEN)
    assert result.trained and result.metrics["optimizer_steps"] == 3  # 7 sequences: 3 + 3 + 1
    assert max(float(s["step"]) for s in policy.optimizer.state.values()) == 3


# --------------------------------------------------------------------------- checkpoints


def test_save_restore_resumes_exactly(model_path, tmp_path):
    config = TrainConfig(learning_rate=1e-2, loss_fn="grpo")
    policy = make_policy(model_path, micro_batch_size=3)
    first, second = scored_groups(policy), scored_groups(policy)[::-1]
    policy.train_step(first, config, max_seq_len=MAX_SEQ_LEN)
    checkpoint = policy.save(tmp_path / "ckpt")
    saved = adapter_weights(policy)

    policy.train_step(second, config, max_seq_len=MAX_SEQ_LEN)  # the run that was never interrupted
    uninterrupted = adapter_weights(policy)

    restored = Policy.restore(checkpoint, model_path, LoraSettings(), OptimSettings(micro_batch_size=3))
    assert restored.step == 1
    assert max_difference(saved, adapter_weights(restored)) == 0.0
    result = restored.train_step(second, config, max_seq_len=MAX_SEQ_LEN)
    assert result.step == 2
    assert max_difference(uninterrupted, adapter_weights(restored)) < 1e-6
    assert max_difference(uninterrupted, saved) > 1e-3  # the step did move the weights

    # Without the optimizer's moments the same step lands elsewhere: they are what makes it exact.
    amnesiac = make_policy(model_path, micro_batch_size=3)
    amnesiac.load_adapter_weights(checkpoint / "adapter")
    amnesiac.train_step(second, config, max_seq_len=MAX_SEQ_LEN)
    assert max_difference(uninterrupted, adapter_weights(amnesiac)) > 1e-4

    moments = load_file(checkpoint / "optimizer.safetensors")
    names = json.loads((checkpoint / "optimizer.json").read_text())["param_names"]
    assert names == [n for n, _ in policy.named_trainable]
    for index in range(len(names)):
        assert {f"{index}.exp_avg", f"{index}.exp_avg_sq", f"{index}.step"} <= moments.keys()
    assert float(moments["0.step"]) == 1.0
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state["step"] == 1 and state["optimizer_steps"] == 1 and state["seed"] == 0
    assert state["lora"]["target_modules"][-1] == "lm_head"
    assert not [p for p in checkpoint.rglob("*") if p.suffix in (".bin", ".pt", ".pth", ".pkl")]


def test_restore_refuses_other_lora_settings(model_path, tmp_path):
    policy = make_policy(model_path)
    policy.save(tmp_path / "ckpt")
    with pytest.raises(ValueError, match="LoRA"):
        Policy.restore(tmp_path / "ckpt", model_path, LoraSettings(rank=4), OptimSettings())
    with pytest.raises(FileNotFoundError):
        Policy.restore(tmp_path / "nothing", model_path, LoraSettings(), OptimSettings())


def test_save_replaces_a_checkpoint_whole(model_path, tmp_path):
    policy = make_policy(model_path)
    policy.save(tmp_path / "ckpt")
    policy.train_step(scored_groups(policy), TrainConfig(learning_rate=1e-3), max_seq_len=MAX_SEQ_LEN)
    policy.save(tmp_path / "ckpt")
    assert json.loads((tmp_path / "ckpt" / "trainer_state.json").read_text())["step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no partial or old copies left


def test_optimizer_state_round_trips_without_pickle():
    params = [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(4))]
    optimizer = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
    (params[0].sum() + params[1].pow(2).sum()).backward()
    optimizer.step()
    tensors, structure = flatten_optimizer_state(optimizer.state_dict(), ["a", "b"])
    assert set(tensors) == {f"{i}.{k}" for i in (0, 1) for k in ("step", "exp_avg", "exp_avg_sq")}
    json.dumps(structure)  # the rest is plain JSON
    back = unflatten_optimizer_state(tensors, json.loads(json.dumps(structure)))
    assert back["param_groups"] == optimizer.state_dict()["param_groups"]
    for index, entries in optimizer.state_dict()["state"].items():
        for key, value in entries.items():
            assert torch.equal(back["state"][index][key], value)


async def test_saved_adapter_loads_in_the_inference_engine(model_path, tmp_path):
    policy = make_policy(model_path)
    for _ in range(3):
        policy.train_step(scored_groups(policy), TrainConfig(learning_rate=1e-2), max_seq_len=MAX_SEQ_LEN)
    checkpoint = policy.save(tmp_path / "ckpt")
    adapter = policy.adapter_dir(checkpoint)
    assert adapter == checkpoint / "adapter"
    files = {p.name for p in adapter.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= files
    assert not [f for f in files if f.endswith(".bin")]
    # Only LoRA weights: the frozen (tied) lm_head of the base model is not copied into the adapter.
    assert all("lora_" in k for k in load_file(adapter / "adapter_model.safetensors"))

    engine = TransformersEngine(model_path)
    await engine.start()
    try:
        await engine.load_adapter("tiny@1", adapter)
        params = SamplingParams(max_tokens=8, temperature=1.0, logprobs=True, seed=7)
        prompt = prompt_ids(policy)
        (tuned,) = await engine.generate(GenerationRequest(prompt, params, adapter="tiny@1"))
        (base,) = await engine.generate(GenerationRequest(prompt, params, adapter=None))
    finally:
        await engine.close()
    policy.model.eval()
    served = torch.tensor(tuned.logprobs)
    assert completion_logprobs(policy, tuned.token_ids) == pytest.approx(served, abs=1e-4)
    with policy.model.disable_adapter():
        base_view = completion_logprobs(policy, tuned.token_ids)
    assert (base_view - served).abs().max() > 1e-2  # the engine served the adapter, not the base model
    assert base.logprobs  # and the base model is still there


# --------------------------------------------------------------------------- learning


def test_learns_the_half_alphabet_task(model_path):
    """Sampled with model.generate (2 groups x 8 samples of <= 8 tokens at temperature 1), rewarded
    by the share of characters in a-m: mean reward from ~0.4 to >= 0.8 within 60 steps."""
    torch.manual_seed(0)
    policy = make_policy(model_path, micro_batch_size=16)
    config = TrainConfig(learning_rate=1e-2, loss_fn="cispo")
    curve = []
    for _ in range(60):
        policy.model.eval()
        groups = half_alphabet_groups(policy.model, policy.tokenizer)
        result = policy.train_step(groups, config, max_seq_len=MAX_SEQ_LEN)
        curve.append(round(result.metrics["reward_mean"], 3))
        if curve[-1] >= 0.8:
            break
    print("half-alphabet reward by step:", curve)
    assert curve[0] < 0.6
    assert curve[-1] >= 0.8, curve
