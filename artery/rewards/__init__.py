"""Rewards computed from the trajectories themselves: RULER, an LLM judge that ranks a group."""

from artery.rewards.ruler import DEFAULT_RUBRIC, RulerError, TrajectoryScore, ruler, ruler_score_group

__all__ = ["DEFAULT_RUBRIC", "RulerError", "TrajectoryScore", "ruler", "ruler_score_group"]
