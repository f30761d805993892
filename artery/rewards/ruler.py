"""RULER in the agent's process (ART's ``art.rewards.ruler``): the judge's core is
``artery.shared.ruler``, shared with the reward service; this adds ART's group-level helper."""

from __future__ import annotations

import copy
import logging
from pprint import pprint
from typing import Any

from artery.shared import ruler as core
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
    ruler_judgement,
)
from artery.trajectories import Trajectory, TrajectoryGroup
from artery.utils.reward_given import reward_given

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


async def ruler(
    message_lists: list[list[Any]],
    judge_model: str = "openai/o3",
    extra_litellm_params: dict[str, Any] | None = None,
    rubric: str = DEFAULT_RUBRIC,
    tools: list[Any] | None = None,
    *,
    debug: bool = False,
    max_attempts: int = 2,
) -> list[TrajectoryScore]:
    """Score each message list relative to the others with an LLM judge, one score per list.

    ``debug=True`` (ART's) prints what the judge is asked and each score with its explanation."""
    if debug and message_lists:
        print("[RULER] judge prompt:")
        pprint(build_judge_messages(message_lists, rubric, tools))
    scores = await core.ruler(
        message_lists, judge_model, extra_litellm_params, rubric, tools, max_attempts=max_attempts
    )
    if debug:
        print("[RULER] scores:")
        pprint(
            [
                {"trajectory_id": s.trajectory_id, "score": s.score, "explanation": s.explanation}
                for s in scores
            ]
        )
    return scores


async def ruler_score_group(
    group: TrajectoryGroup,
    judge_model: str = "openai/o3",
    extra_litellm_params: dict[str, Any] | None = None,
    rubric: str = DEFAULT_RUBRIC,
    *,
    swallow_exceptions: bool = False,
    debug: bool = False,
) -> TrajectoryGroup | None:
    """A copy of the group with ``reward = metrics["ruler_score"]`` set by the judge.

    The original reward, when one was given, is kept in ``metrics["independent_reward"]``. With
    ``swallow_exceptions`` a failure returns ``None`` (log it and drop the group) instead of
    raising. ``debug=True`` prints the judge's prompt and scores (``ruler``).
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
            debug=debug,
        )
    except Exception:
        if swallow_exceptions:
            log.exception("RULER failed; dropping the group")
            return None
        raise
    for trajectory, score in zip(new_trajectories, scores, strict=True):
        if reward_given(trajectory.reward):
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
