"""A trajectory's reward before one is given (``NoReward``): it reads as 0.0, as ART 0.5's default
does, so arithmetic and progress bars work, but it is never published for training or logging as
0.0 (``artery.trajectories.require_rewards``)."""

from __future__ import annotations

from typing import Any


class NoReward(float):
    """No reward was given (a float of 0.0 that says so)."""

    def __new__(cls):
        return super().__new__(cls, 0.0)

    def __repr__(self) -> str:
        return "NoReward()"

    def __reduce__(self):
        return (NoReward, ())


def reward_given(reward: Any) -> bool:
    return not isinstance(reward, NoReward)
