"""Writing groups and trajectories to PostgreSQL, idempotently, a batch per transaction."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass

import asyncpg
import msgspec

from artery.schemas import TrajectoryGroupSubmitted

_json = msgspec.json.Encoder()


def _encode(value) -> bytes:
    """JSON for a jsonb column. PostgreSQL's jsonb cannot hold U+0000, which a model can sample
    (a byte-level token): it is stored as U+FFFD. Only the display text changes; the sampled
    token ids, which training uses, are kept exactly."""
    data = _json.encode(value)
    return data.replace(b"\\u0000", b"\\ufffd") if b"\\u0000" in data else data


# One statement for the whole batch: arrays in, the ids that were new out. ON CONFLICT makes a
# redelivered group a no-op, and RETURNING tells us which trajectories still need writing.
_INSERT_GROUPS = """
INSERT INTO trajectory_groups (id, project, model, step, split, num_trajectories, num_exceptions,
    reward_mean, needs_reward, submitted_at, stream_seq, metadata, metrics, exceptions, logs,
    reward_spec)
SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::int[], $5::text[], $6::int[],
    $7::int[], $8::float8[], $9::bool[], $10::timestamptz[], $11::bigint[], $12::jsonb[],
    $13::jsonb[], $14::jsonb[], $15::jsonb[], $16::jsonb[])
ON CONFLICT (id) DO NOTHING
RETURNING id
"""

_INSERT_MODELS = """
INSERT INTO models (project, name) SELECT * FROM unnest($1::text[], $2::text[])
ON CONFLICT DO NOTHING
"""


def reward_mean(rewards: list[float]) -> float:
    """The mean of finite rewards, finite too: dividing first cannot overflow (two rewards of
    1e308 sum to infinity, which the column would store)."""
    return sum(r / len(rewards) for r in rewards)


def needs_reward(group: TrajectoryGroupSubmitted) -> bool:
    return group.reward is not None and group.reward.ruler is not None


@dataclass(frozen=True, slots=True)
class StoredGroup:
    """A decoded group reduced to what is written and announced: its fields, and each trajectory
    already encoded as the JSON body that is stored.

    Built right after decoding, so that a batch keeps a handful of objects per group alive rather
    than every decoded message, sample and list: with a whole batch of decoded trees alive,
    CPython's cyclic garbage collector ran over them again and again, and took about twice the
    CPU of decoding itself (``make bench``).
    """

    id: str
    project: str
    model: str
    step: int | None
    split: str
    time: dt.datetime
    stream_seq: int | None
    rewards: list[float]
    bodies: list[bytes]  # one per trajectory, in order
    num_exceptions: int
    needs_reward: bool
    metadata: bytes
    metrics: bytes
    exceptions: bytes
    logs: bytes
    reward_spec: bytes | None

    @classmethod
    def of(cls, group: TrajectoryGroupSubmitted, stream_seq: int | None) -> StoredGroup:
        return cls(
            id=group.id,
            project=group.project,
            model=group.model,
            step=group.step,
            split=group.split,
            time=group.time,
            stream_seq=stream_seq,
            rewards=[t.reward for t in group.trajectories],
            bodies=[_encode(t) for t in group.trajectories],
            num_exceptions=len(group.exceptions),
            needs_reward=needs_reward(group),
            metadata=_encode(group.metadata),
            metrics=_encode(group.metrics),
            exceptions=_encode(group.exceptions),
            logs=_encode(group.logs),
            reward_spec=_encode(group.reward) if group.reward is not None else None,
        )


async def write_groups(conn: asyncpg.Connection, batch: Sequence[StoredGroup]) -> set[str]:
    """Store the batch in one transaction; return the ids that were not stored before."""
    unique: dict[str, StoredGroup] = {}
    for item in batch:  # the same group twice in one batch is stored once
        unique.setdefault(item.id, item)
    groups = list(unique.values())
    if not groups:
        return set()
    columns = (
        [g.id for g in groups],
        [g.project for g in groups],
        [g.model for g in groups],
        [g.step for g in groups],
        [g.split for g in groups],
        [len(g.bodies) for g in groups],
        [g.num_exceptions for g in groups],
        [reward_mean(g.rewards) for g in groups],
        [g.needs_reward for g in groups],
        [g.time for g in groups],
        [g.stream_seq for g in groups],
        [g.metadata for g in groups],
        [g.metrics for g in groups],
        [g.exceptions for g in groups],
        [g.logs for g in groups],
        [g.reward_spec for g in groups],
    )
    async with conn.transaction():
        models = sorted({(g.project, g.model) for g in groups})
        await conn.execute(_INSERT_MODELS, [p for p, _ in models], [m for _, m in models])
        new_ids = {row["id"] for row in await conn.fetch(_INSERT_GROUPS, *columns)}
        records = [
            (g.id, idx, reward, body)
            for g in groups
            if g.id in new_ids
            for idx, (reward, body) in enumerate(zip(g.rewards, g.bodies, strict=True))
        ]
        if records:
            # COPY is the fastest path in; safe because these groups are new in this transaction.
            await conn.copy_records_to_table(
                "trajectories", records=records, columns=("group_id", "idx", "reward", "body")
            )
    return new_ids
