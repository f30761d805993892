"""Asynchronous (off-policy) training: staleness read from the samples, stale ones dropped and
counted, the policy gap corrected by truncated importance sampling — pure parts, checked by hand."""

from __future__ import annotations

import math

import pytest
import torch

from artery.schemas import Message, Sample, TrainConfig, Trajectory
from artery.services.trainer.losses import (
    DEFAULT_OFF_POLICY_TIS_CAP,
    LossConfig,
    LossInputs,
    importance_stats,
    off_policy_inputs,
    select_loss,
)
from artery.services.trainer.policy import loss_config
from artery.services.trainer.staleness import drop_stale, sampled_step


def trajectory(*served: str | None, initial: int | None = None, reward: float = 0.0) -> Trajectory:
    messages = [Message(role="user", content="q")]
    for name in served:
        sample = Sample(token_ids=[1], logprobs=[-0.5], served_model=name)
        messages.append(Message(role="assistant", content="a", sample=sample))
    return Trajectory(messages=messages, reward=reward, initial_policy_version=initial)


def test_the_sampling_step_is_the_oldest_served_step_else_the_trajectorys_claim():
    assert sampled_step(trajectory("agent@3", "agent@5"), "agent") == 3
    assert sampled_step(trajectory("agent@4", None), "agent") == 4
    # Another model's name, or none at all: the trajectory's own claim, else unknown.
    assert sampled_step(trajectory("other@1", initial=2), "agent") == 2
    assert sampled_step(trajectory(None), "agent") is None


def test_stale_trajectories_are_dropped_and_counted_never_trained_silently():
    groups = [
        [trajectory("agent@5"), trajectory("agent@4"), trajectory("agent@2")],  # staleness 0, 1, 3
        [trajectory("agent@3"), trajectory(None)],  # staleness 2, unknown
    ]
    kept, report = drop_stale(groups, model="agent", current_step=5, max_steps_off_policy=2)
    assert [len(g) for g in kept] == [2, 2]
    assert sorted(report.staleness) == [0, 1, 2] and report.dropped == 1 and report.unknown == 1
    metrics = report.metrics()
    assert metrics["offpolicy/trajectories_dropped"] == 1.0
    assert metrics["offpolicy/dropped_fraction"] == pytest.approx(1 / 4)
    assert metrics["offpolicy/staleness_mean"] == pytest.approx(1.0)
    assert metrics["offpolicy/staleness_max"] == 2.0
    assert [metrics[f"offpolicy/staleness_{b}"] for b in ("0", "1", "2", "3+")] == [1.0, 1.0, 1.0, 0.0]
    with pytest.raises(ValueError):
        drop_stale(groups, model="agent", current_step=5, max_steps_off_policy=-1)


def test_off_policy_loss_is_the_policy_gradient_weighted_by_the_truncated_is_ratio():
    """cispo with old := current (detached) and the sampler's logprobs in the TIS weight: per
    token ``-min(exp(cur - sampled), c) * A * logp``, reduced over the trained tokens."""
    current = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)  # [B=1,T=3]
    sampled = torch.tensor([[-1.5, -0.5, float("nan")]])  # ratios e^0.5, e^-1.5, unknown
    mask = torch.tensor([[1.0, 1.0, 1.0]])
    advantages = torch.tensor([2.0])
    config = loss_config(TrainConfig(loss_fn="cispo"), max_seq_len=16, off_policy=True)
    assert config.truncated_importance_sampling == DEFAULT_OFF_POLICY_TIS_CAP
    old, sampler = off_policy_inputs(current, sampled)
    out = select_loss(config)(
        LossInputs(
            logprobs=current, old_logprobs=old, advantages=advantages, mask=mask, sampler_logprobs=sampler
        )
    )
    weights = [min(math.exp(0.5), 2.0), math.exp(-1.5), 1.0]  # unknown sampler logprob: weight 1
    expected = -sum(w * 2.0 * lp for w, lp in zip(weights, [-1.0, -2.0, -0.5], strict=True)) / 3
    assert float(out.loss.detach()) == pytest.approx(expected, rel=1e-6)
    assert float(out.ratio_mean) == pytest.approx(1.0)  # current vs itself: the clip never bites
    out.loss.backward()
    assert current.grad.tolist()[0] == pytest.approx([-w * 2.0 / 3 for w in weights], rel=1e-6)

    ratio_mean, truncated = importance_stats(old, sampler, mask, DEFAULT_OFF_POLICY_TIS_CAP)
    assert ratio_mean == pytest.approx((math.exp(0.5) + math.exp(-1.5)) / 2)
    assert truncated == pytest.approx(0.0)  # e^0.5 < 2
    _, truncated_at_1 = importance_stats(old, sampler, mask, 1.0)
    assert truncated_at_1 == pytest.approx(0.5)


def test_a_requested_cap_wins_and_sync_mode_is_unchanged():
    assert loss_config(TrainConfig(truncated_importance_sampling=1.5), max_seq_len=8, off_policy=True) == (
        LossConfig(name="cispo", max_completion_length=8, truncated_importance_sampling=1.5)
    )
    assert loss_config(TrainConfig(), max_seq_len=8).truncated_importance_sampling is None
