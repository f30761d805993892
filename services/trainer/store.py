"""What the trainer reads from and writes to PostgreSQL."""

from __future__ import annotations

import json
from collections.abc import Sequence

import asyncpg
import msgspec

from artery.schemas import Trajectory

_trajectory = msgspec.json.Decoder(Trajectory)


async def stored_group_ids(conn: asyncpg.Connection, group_ids: Sequence[str]) -> set[str]:
    rows = await conn.fetch("SELECT id FROM trajectory_groups WHERE id = ANY($1::text[])", list(group_ids))
    return {r["id"] for r in rows}


async def load_groups(conn: asyncpg.Connection, group_ids: Sequence[str]) -> list[list[Trajectory]]:
    """The groups' trajectories, in the order of ``group_ids`` and of their index in each group."""
    rows = await conn.fetch(
        "SELECT group_id, idx, body::text AS body FROM trajectories"
        " WHERE group_id = ANY($1::text[]) ORDER BY group_id, idx",
        list(group_ids),
    )
    by_group: dict[str, list[Trajectory]] = {gid: [] for gid in group_ids}
    for row in rows:
        by_group[row["group_id"]].append(_trajectory.decode(row["body"]))
    return [by_group[gid] for gid in group_ids]


async def completed_step(conn: asyncpg.Connection, request_id: str) -> tuple[int, dict] | None:
    row = await conn.fetchrow(
        "SELECT step, metrics::text AS m FROM training_steps WHERE request_id = $1", request_id
    )
    return None if row is None else (row["step"], json.loads(row["m"]))


async def record_step(
    conn: asyncpg.Connection,
    *,
    request_id: str,
    project: str,
    model: str,
    step: int,
    group_ids: Sequence[str],
    trained: bool,
    metrics: dict,
) -> None:
    await conn.execute(
        "INSERT INTO training_steps (request_id, project, model, step, group_ids, trained, metrics)"
        " VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT (request_id) DO NOTHING",
        request_id,
        project,
        model,
        step,
        list(group_ids),
        trained,
        msgspec.json.encode(metrics),
    )
