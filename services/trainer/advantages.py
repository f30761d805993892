"""Group-relative advantages: how much better each rollout did than its siblings.

GRPO needs no value model: the baseline of a rollout is the mean reward of its group (the rollouts
of the same input). A group whose rewards are all equal carries no signal; its advantages are
exactly zero (not rounding noise from ``x - mean(x)``), so the tokenizer can drop every one of its
trajectories and no backward pass is spent on it.
"""

from __future__ import annotations

import torch
from torch import Tensor


def is_degenerate(rewards: Tensor) -> bool:
    """Whether a group carries no learning signal: fewer than two rollouts, or all rewards equal."""
    return rewards.numel() < 2 or bool((rewards == rewards.reshape(-1)[0]).all())


def group_advantages(rewards: Tensor, scale: bool, eps: float = 1e-6) -> Tensor:
    """``reward - mean``, divided by ``population std + eps`` when ``scale`` (as ART and GRPO do).

    rewards: [G], the rewards of one group. Returns [G] in the rewards' dtype (floats).
    """
    rewards = rewards.to(torch.promote_types(rewards.dtype, torch.float32))  # [G]
    if is_degenerate(rewards):
        return torch.zeros_like(rewards)  # [G], exact zeros
    centered = rewards - rewards.mean()  # [G]
    if not scale:
        return centered  # [G]
    return centered / (rewards.std(correction=0) + eps)  # [G]
