"""The parts of a training step that need no model: settings, group advantages, micro-batches,
the loss a request picks, SFT's cross-entropy, and the step's metrics from its micro-batches.

``Policy`` (``policy.py``) runs the model through them; each is a pure function tested alone.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from artery.schemas import TrainConfig, Trajectory
from artery.services.trainer.advantages import group_advantages, is_degenerate
from artery.services.trainer.losses import DEFAULT_OFF_POLICY_TIS_CAP, LossConfig, LossFn, select_loss
from artery.services.trainer.sequences import TrainingSequence


@dataclass(frozen=True, kw_only=True)
class OptimSettings:
    """AdamW as ART sets it for RL (betas (0.9, 0.99), weight decay 0.1); the learning rate comes with
    each request. ART clips gradients at 0.1; 1.0 here, as TRL, unless the request says otherwise."""

    betas: tuple[float, float] = (0.9, 0.99)
    weight_decay: float = 0.1
    eps: float = 1e-8
    max_grad_norm: float = 1.0
    #: Sequences per forward/backward pass; gradients accumulate over the optimizer step.
    micro_batch_size: int = 8

    def __post_init__(self) -> None:
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))
        if self.micro_batch_size < 1:
            raise ValueError("micro_batch_size must be at least 1")
        if self.max_grad_norm <= 0:
            raise ValueError("max_grad_norm must be > 0")


@dataclass(frozen=True, kw_only=True)
class StepResult:
    #: The policy version after this call: it advances even when nothing was trained (as ART).
    step: int
    #: Whether an optimizer step changed the adapter.
    trained: bool
    #: Why nothing was trained: ``no_groups``, ``all_groups_skipped``, ``no_trainable_sequences``
    #: or ``non_finite_gradient``; None when trained.
    skip_reason: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)


class DataParallel(Protocol):
    """How the processes of one data-parallel step share an optimizer step (``distributed``): each
    trains its shard with the whole step's normalisers, so summed gradients are the step's."""

    def shard(self, sequences: list[TrainingSequence]) -> list[TrainingSequence]:
        """This process's share of an optimizer step's sequences."""
        ...

    def sum_gradients(self, params: list[Tensor]) -> None:
        """Replace every parameter's gradient by its sum over the processes."""
        ...

    def sum_values(self, values: dict[str, float]) -> dict[str, float]:
        """Each value summed over the processes."""
        ...


@dataclass(frozen=True, kw_only=True)
class GroupPlan:
    """Advantages per trajectory, and the group-level counters of a step."""

    advantages: list[list[float]]
    metrics: dict[str, float]


def plan_groups(groups: Sequence[Sequence[Trajectory]], *, scale_rewards: bool) -> GroupPlan:
    """Group advantages; a group with equal rewards (or fewer than two rollouts) gets exact zeros."""
    advantages: list[list[float]] = []
    equal = too_small = 0
    rewards_all: list[float] = []
    stds: list[float] = []
    for group in groups:
        rewards = torch.tensor([t.reward for t in group], dtype=torch.float64)  # [G]
        if not bool(torch.isfinite(rewards).all()):
            raise ValueError("rewards must be finite")
        rewards_all += rewards.tolist()
        if rewards.numel():
            stds.append(rewards.std(correction=0).item())
        if rewards.numel() < 2:
            too_small += 1
        elif is_degenerate(rewards):
            equal += 1
        advantages.append(group_advantages(rewards, scale=scale_rewards).tolist())
    metrics = {
        "groups": float(len(groups)),
        "groups_skipped_equal_rewards": float(equal),
        "groups_skipped_too_small": float(too_small),
        "reward_mean": mean(rewards_all),
        "reward_std": mean(stds),  # mean within-group (population) std, as ART's reward_std_dev
    }
    return GroupPlan(advantages=advantages, metrics=metrics)


def chunks(items: Sequence[TrainingSequence], size: int) -> Iterator[list[TrainingSequence]]:
    for start in range(0, len(items), size):
        yield list(items[start : start + size])


def trained_tokens(sequence: TrainingSequence) -> int:
    """Trained tokens of a sequence; position 0 is never predicted (``pad_batch`` shifts it away)."""
    return sum(sequence.assistant_mask[1:])


def sft_loss(logprobs: Tensor, mask: Tensor, num_tokens: float) -> Tensor:
    """Supervised fine-tuning's cross-entropy: ``-sum(log p · mask) / num_tokens``.

    ``logprobs`` [B,T-1] are the model's log-probabilities of the next tokens, ``mask`` [B,T-1] is 1
    on the assistant tokens that are trained; ``num_tokens`` counts the trained tokens of the whole
    batch (not of this micro-batch), so the micro-batches' losses add up to the batch's mean over
    its assistant tokens. Positions outside the mask never contribute, whatever they hold.
    """
    picked = torch.where(mask > 0, logprobs, torch.zeros_like(logprobs))  # [B,T-1]
    return -(picked * mask).sum() / num_tokens


@functools.lru_cache(maxsize=16)
def cached_loss(config: LossConfig) -> LossFn:
    """A request picks its loss; the same configuration gets the same selected function."""
    return select_loss(config)


def loss_config(config: TrainConfig, *, max_seq_len: int, off_policy: bool = False) -> LossConfig:
    tis = config.truncated_importance_sampling
    if off_policy and tis is None:  # off-policy samples are always corrected, capped
        tis = DEFAULT_OFF_POLICY_TIS_CAP
    return LossConfig(
        name=config.loss_fn,
        epsilon=config.epsilon,
        epsilon_high=config.epsilon_high,
        # dr_grpo's constant normaliser: TRL uses max_completion_length; a step knows only the
        # longest sequence it accepts (constant over a run, which is what matters).
        max_completion_length=max_seq_len,
        kl_coef=config.kl_penalty_coef,
        truncated_importance_sampling=tis,
    )


def mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values)) if values else 0.0


def merge_updates(updates: list[dict[str, float]]) -> dict[str, float]:
    tokens = sum(u["tokens"] for u in updates)
    merged = {
        "loss": mean([u["loss"] for u in updates]),
        "grad_norm": mean([u["grad_norm"] for u in updates]),
        "ratio_mean": sum(u["ratio_sum"] for u in updates) / tokens,
        "clip_fraction": sum(u["clip_sum"] for u in updates) / tokens,
        "optimizer_steps": float(sum(u["applied"] for u in updates)),
    }
    if "kl_sum" in updates[0]:
        merged["kl_mean"] = sum(u["kl_sum"] for u in updates) / tokens
    if "is_ratio_sum" in updates[0]:
        merged["offpolicy/is_ratio_mean"] = sum(u["is_ratio_sum"] for u in updates) / tokens
        merged["offpolicy/is_truncated_fraction"] = sum(u["is_truncated_sum"] for u in updates) / tokens
    return merged
