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
    score: float
    explanation: str | None = None


class GroupScored(Event, kw_only=True, tag="group.scored"):
    """Published by the reward service: the group's final rewards."""

    group_id: EventId
    split: Split = "train"
    scores: list[TrajectoryScore]
    judge_model: str | None = None


GroupEvent = GroupReady | GroupScored
