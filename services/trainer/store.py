"""What the trainer reads from and writes to PostgreSQL."""

from __future__ import annotations

import json
from collections.abc import Sequence

import asyncpg
import msgspec

from artery.schemas import Trajectory

_trajectory = msgspec.json.Decoder(Trajectory)


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


async def load_groups(
    conn: asyncpg.Connection, project: str, model: str, group_ids: Sequence[str]
) -> list[list[Trajectory]]:
    """The groups' trajectories, in the order of ``group_ids`` and of their index in each group.

    A judged group's rewards are the reward service's (the agent's own is kept in
    ``metrics["independent_reward"]``, the judge's in ``metrics["ruler_score"]``, as ART's RULER
    does); a group the judge could not score is left out.
    """
    unscored = {
        r["group_id"]
        for r in await conn.fetch(
            "SELECT group_id FROM group_rewards WHERE group_id = ANY($1::text[])"
            " AND project = $2 AND model = $3 AND error IS NOT NULL",
            list(group_ids),
            project,
            model,
        )
    }
    rows = await conn.fetch(
        "SELECT t.group_id, t.idx, t.body::text AS body, r.reward AS judged, r.judge_score,"
        " r.independent_reward FROM trajectories t"
        " LEFT JOIN trajectory_rewards r ON r.project = t.project AND r.model = t.model"
        " AND r.group_id = t.group_id AND r.idx = t.idx"
        " WHERE t.project = $2 AND t.model = $3 AND t.group_id = ANY($1::text[])"
        " ORDER BY t.group_id, t.idx",
        list(group_ids),
        project,
        model,
    )
    by_group: dict[str, list[Trajectory]] = {gid: [] for gid in group_ids if gid not in unscored}
    found = {row["group_id"] for row in rows}
    by_group = {gid: ts for gid, ts in by_group.items() if gid in found}  # another model's: left out
    for row in rows:
        if row["group_id"] in unscored:
            continue
        trajectory = _trajectory.decode(row["body"])
        if row["judged"] is not None:
            trajectory.metrics = {
                **trajectory.metrics,
                "independent_reward": row["independent_reward"],
                "ruler_score": row["judge_score"],
            }
            trajectory.reward = row["judged"]
        by_group[row["group_id"]].append(trajectory)
    return [by_group[gid] for gid in group_ids if gid in by_group]


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
