"""Turning raw messages into trusted trajectory groups (pure: no NATS, no database).

The schema (msgspec) checks shapes and types; this adds what a type cannot say: finite numbers,
a subject that matches the payload, sizes within bounds.
"""

from __future__ import annotations

import datetime as dt
import math

from artery.schemas import TrajectoryGroupSubmitted
from artery.shared import subjects
from artery.shared.codec import EventDecoder
from artery.shared.errors import InvalidMessage

_decoder = EventDecoder(TrajectoryGroupSubmitted)


def decode_group(
    subject: str,
    data: bytes,
    content_type: str | None,
    *,
    max_bytes: int,
    max_trajectories: int,
) -> TrajectoryGroupSubmitted:
    if len(data) > max_bytes:
        raise InvalidMessage("too_large", f"{len(data)} bytes is more than the limit of {max_bytes}")
    if not data:
        raise InvalidMessage("decode", "empty message")
    try:
        group = _decoder.decode(data, content_type)
    # msgspec raises these outside its DecodeError; escaping the handler, they failed (and
    # redelivered) the whole batch, good groups included, until all were dead-lettered as poison.
    except UnicodeDecodeError as exc:
        raise InvalidMessage("decode", f"a string is not valid UTF-8: {exc}") from None
    except RecursionError:
        raise InvalidMessage("decode", "nested too deeply to decode") from None
    names = subjects.parse_trajectories(subject)
    if names != (group.project, group.model):
        raise InvalidMessage(
            "subject_mismatch",
            f"published on {subject!r} but names project {group.project!r} and model {group.model!r}",
            original_id=group.id,
        )
    if len(group.trajectories) > max_trajectories:
        raise InvalidMessage(
            "too_large",
            f"{len(group.trajectories)} trajectories is more than the limit of {max_trajectories}",
            original_id=group.id,
        )
    check_finite(group)
    try:  # PostgreSQL stores it in UTC, where it must still be a valid datetime
        group.time.astimezone(dt.UTC)
    except OverflowError:
        raise InvalidMessage(
            "validation", f"time {group.time.isoformat()} is out of range in UTC", original_id=group.id
        ) from None
    return group


def check_finite(group: TrajectoryGroupSubmitted) -> None:
    """NaN and infinities would poison every mean and every advantage downstream; in metadata,
    PostgreSQL's jsonb cannot hold them and they would come back as null."""
    for i, trajectory in enumerate(group.trajectories):
        if not math.isfinite(trajectory.reward):
            raise InvalidMessage(
                "non_finite",
                f"trajectories[{i}].reward is {trajectory.reward}",
                original_id=group.id,
            )
        _check_finite_values(trajectory.metrics, f"trajectories[{i}].metrics", group.id)
        _check_finite_values(trajectory.metadata, f"trajectories[{i}].metadata", group.id)
        for m, message in enumerate(trajectory.messages):
            sample = message.sample
            if sample is None:
                continue
            where = f"trajectories[{i}].messages[{m}].sample"
            if len(sample.token_ids) != len(sample.logprobs):
                raise InvalidMessage(
                    "validation",
                    f"{where}: {len(sample.token_ids)} token ids but {len(sample.logprobs)} logprobs",
                    original_id=group.id,
                )
            if not all(map(math.isfinite, sample.logprobs)):
                raise InvalidMessage(
                    "non_finite", f"{where}.logprobs has a non-finite value", original_id=group.id
                )
    _check_finite_values(group.metrics, "metrics", group.id)
    _check_finite_values(group.metadata, "metadata", group.id)


def _check_finite_values(values: dict, where: str, group_id: str) -> None:
    for key, value in values.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise InvalidMessage("non_finite", f"{where}[{key!r}] is {value}", original_id=group_id)
