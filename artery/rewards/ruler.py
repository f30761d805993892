"""RULER in the agent's process (ART's ``art.rewards.ruler``): the judge's core is
``artery.shared.ruler``, shared with the reward service; this adds ART's group-level helper."""

from __future__ import annotations

import copy
import logging
from typing import Any

from artery.shared.ruler import (
    DEFAULT_RUBRIC,
    RESPONSE_FORMAT,
    RESPONSE_SCHEMA,
    SYSTEM_PROMPT,
    Judgement,
    RulerError,
    TrajectoryScore,
    build_judge_messages,
    common_prefix_len,
    parse_scores,
    ruler,
    ruler_judgement,
)
from artery.trajectories import Trajectory, TrajectoryGroup

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_RUBRIC",
    "RESPONSE_FORMAT",
    "RESPONSE_SCHEMA",
    "SYSTEM_PROMPT",
    "Judgement",
    "RulerError",
    "TrajectoryScore",
    "build_judge_messages",
    "common_prefix_len",
    "parse_scores",
    "ruler",
    "ruler_judgement",
    "ruler_score_group",
]


async def ruler_score_group(
    group: TrajectoryGroup,
    judge_model: str = "openai/o3",
    extra_litellm_params: dict[str, Any] | None = None,
    rubric: str = DEFAULT_RUBRIC,
    *,
    swallow_exceptions: bool = False,
) -> TrajectoryGroup | None:
    """A copy of the group with ``reward = metrics["ruler_score"]`` set by the judge.

    The original reward is kept in ``metrics["independent_reward"]``. With ``swallow_exceptions``
    a failure returns ``None`` (log it and drop the group) instead of raising.
    """
    for trajectory in group.trajectories:
        if trajectory.additional_histories:
            raise ValueError("ruler_score_group does not support trajectories with additional_histories")
    new_trajectories: list[Trajectory] = [copy.deepcopy(t) for t in group.trajectories]
    try:
        scores = await ruler(
            [t.messages() for t in new_trajectories],
            judge_model=judge_model,
            extra_litellm_params=extra_litellm_params,
            rubric=rubric,
            tools=new_trajectories[0].tools if new_trajectories else None,
        )
    except Exception:
        if swallow_exceptions:
            log.exception("RULER failed; dropping the group")
            return None
        raise
    for trajectory, score in zip(new_trajectories, scores, strict=True):
        trajectory.metrics["independent_reward"] = trajectory.reward
        trajectory.metrics["ruler_score"] = score.score
        trajectory.reward = score.score
        trajectory.log(f"RULER explanation: {score.explanation}")
    return TrajectoryGroup(
        new_trajectories,
        exceptions=list(group.exceptions),
        metadata=copy.deepcopy(group.metadata),
        metrics=dict(group.metrics),
        logs=list(group.logs),
        reward=group.reward,
    )
