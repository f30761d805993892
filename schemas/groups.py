"""Collector → reward → trainer: a stored group is ready, then scored."""

from __future__ import annotations

from typing import Annotated

import msgspec

from artery.schemas.base import Event, EventId, Split, Struct


class GroupReady(Event, kw_only=True, tag="group.ready"):
    """Published by the collector after the group's rows are committed.

    ``id`` is derived from the group id (``ready:<group_id>``) so a redelivered submission
    never yields a second ``group.ready``.
    """

    group_id: EventId
    split: Split = "train"
    num_trajectories: Annotated[int, msgspec.Meta(ge=1)]
    #: Rewards as submitted, by trajectory index.
    rewards: list[float]
    #: Whether the reward service must score it before training (RULER was asked for).
    needs_reward: bool = False
    #: Sequence of the submission in the TRAJECTORIES stream, to replay it without the database.
    stream_seq: int | None = None


class TrajectoryScore(Struct, kw_only=True):
    index: Annotated[int, msgspec.Meta(ge=0)]
    #: The reward the trainer uses (the judge's score, plus the agent's own when combined).
    score: float
    explanation: str | None = None
    #: The judge's score alone, in [0, 1].
    judge_score: float | None = None
    #: The reward the agent submitted, kept for comparison.
    independent_reward: float | None = None


class JudgeUsage(Struct, kw_only=True):
    """What scoring one group cost: judge calls, tokens and, when the provider's price is known, USD."""

    attempts: Annotated[int, msgspec.Meta(ge=1)]
    prompt_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0
    completion_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0
    cost_usd: float | None = None


class GroupScored(Event, kw_only=True, tag="group.scored"):
    """Published by the reward service: the group's final rewards."""

    group_id: EventId
    split: Split = "train"
    scores: list[TrajectoryScore]
    judge_model: str | None = None
    usage: JudgeUsage | None = None


GroupEvent = GroupReady | GroupScored
