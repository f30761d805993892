"""Rewards computed from the trajectories themselves: RULER, an LLM judge that ranks a group."""

from artery.rewards.ruler import (
    DEFAULT_RUBRIC,
    Judgement,
    RulerError,
    TrajectoryScore,
    ruler,
    ruler_judgement,
    ruler_score_group,
)

__all__ = [
    "DEFAULT_RUBRIC",
    "Judgement",
    "RulerError",
    "TrajectoryScore",
    "ruler",
    "ruler_judgement",
    "ruler_score_group",
]
