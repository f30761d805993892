"""Writing groups and trajectories to PostgreSQL, idempotently, a batch per transaction."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import asyncpg
import msgspec

from artery.schemas import TrajectoryGroupSubmitted

_encode = msgspec.json.Encoder().encode

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


@dataclass(frozen=True)
class StoredGroup:
    group: TrajectoryGroupSubmitted
    stream_seq: int | None


def needs_reward(group: TrajectoryGroupSubmitted) -> bool:
    return group.reward is not None and group.reward.ruler is not None


async def write_groups(conn: asyncpg.Connection, batch: Sequence[StoredGroup]) -> set[str]:
    """Store the batch in one transaction; return the ids that were not stored before."""
    unique: dict[str, StoredGroup] = {}
    for item in batch:  # the same group twice in one batch is stored once
        unique.setdefault(item.group.id, item)
    batch = list(unique.values())
    if not batch:
        return set()
    groups = [item.group for item in batch]
    columns = (
        [g.id for g in groups],
        [g.project for g in groups],
        [g.model for g in groups],
        [g.step for g in groups],
        [g.split for g in groups],
        [len(g.trajectories) for g in groups],
        [len(g.exceptions) for g in groups],
        [sum(t.reward for t in g.trajectories) / len(g.trajectories) for g in groups],
        [needs_reward(g) for g in groups],
        [g.time for g in groups],
        [item.stream_seq for item in batch],
        [_encode(g.metadata) for g in groups],
        [_encode(g.metrics) for g in groups],
        [_encode(g.exceptions) for g in groups],
        [_encode(g.logs) for g in groups],
        [_encode(g.reward) if g.reward is not None else None for g in groups],
    )
    async with conn.transaction():
        models = sorted({(g.project, g.model) for g in groups})
        await conn.execute(_INSERT_MODELS, [p for p, _ in models], [m for _, m in models])
        new_ids = {row["id"] for row in await conn.fetch(_INSERT_GROUPS, *columns)}
        records = [
            (g.id, idx, t.reward, _encode(t))
            for g in groups
            if g.id in new_ids
            for idx, t in enumerate(g.trajectories)
        ]
        if records:
            # COPY is the fastest path in; safe because these groups are new in this transaction.
            await conn.copy_records_to_table(
                "trajectories", records=records, columns=("group_id", "idx", "reward", "body")
            )
    return new_ids
