"""What the trainer reads from and writes to PostgreSQL."""

from __future__ import annotations

import json
from collections.abc import Sequence

import asyncpg
import msgspec

from artery.shared.stored_groups import trained_groups


async def stored_group_ids(
    conn: asyncpg.Connection, project: str, model: str, group_ids: Sequence[str]
) -> set[str]:
    """The model's groups that are ready to train on: stored, and judged when they asked for a
    judge (a verdict row exists, scores or error). Group ids are the agents' own, unique only
    within a model: another model's groups are never found."""
    rows = await conn.fetch(
        "SELECT g.id FROM trajectory_groups g WHERE g.id = ANY($1::text[])"
        " AND g.project = $2 AND g.model = $3"
        " AND (NOT g.needs_reward OR EXISTS (SELECT 1 FROM group_rewards r"
        " WHERE r.project = g.project AND r.model = g.model AND r.group_id = g.id))",
        list(group_ids),
        project,
        model,
    )
    return {r["id"] for r in rows}


async def stored_bytes(conn: asyncpg.Connection, project: str, model: str, group_ids: Sequence[str]) -> int:
    """The size of the groups' stored trajectories (their JSON text), read before loading them."""
    total = await conn.fetchval(
        "SELECT coalesce(sum(octet_length(body::text)), 0) FROM trajectories"
        " WHERE project = $2 AND model = $3 AND group_id = ANY($1::text[])",
        list(group_ids),
        project,
        model,
    )
    return int(total)


#: The groups to train on, in the request's order: the read model replay shares (``shared.stored_groups``).
load_groups = trained_groups


async def completed_step(
    conn: asyncpg.Connection, project: str, model: str, request_id: str
) -> tuple[int, dict, list[str]] | None:
    """The step a request (keyed within its model: ids are the agents') produced, its metrics,
    and the group ids it named."""
    row = await conn.fetchrow(
        "SELECT step, metrics::text AS m, group_ids FROM training_steps"
        " WHERE project = $1 AND model = $2 AND request_id = $3",
        project,
        model,
        request_id,
    )
    return None if row is None else (row["step"], json.loads(row["m"]), list(row["group_ids"]))


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
        " VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT (project, model, request_id) DO NOTHING",
        request_id,
        project,
        model,
        step,
        list(group_ids),
        trained,
        msgspec.json.encode(metrics),
    )
