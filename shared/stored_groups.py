"""The stored groups as the trainer trains on them: one read model, for the trainer and for replay.

A judged group's rewards are the reward service's (the agent's own is kept in
``metrics["independent_reward"]``, the judge's in ``metrics["ruler_score"]``, as ART's RULER
does); a group the judge could not score (its verdict is an error) is left out. ``artery replay``
reads the same model, so a replayed step trains on exactly what the original step did.
"""

from __future__ import annotations

from collections.abc import Sequence

import asyncpg
import msgspec

from artery.schemas import Trajectory

_trajectory = msgspec.json.Decoder(Trajectory)


async def trained_trajectories(
    conn: asyncpg.Connection, project: str, model: str, group_ids: Sequence[str]
) -> dict[str, list[Trajectory]]:
    """Each group's trajectories in index order, judged rewards in place, by group id. Absent: a
    group the judge could not score, and one not stored under this model (group ids are the
    agents' own, unique only within a model)."""
    unscorable = {
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
    by_group: dict[str, list[Trajectory]] = {}
    for row in rows:
        if row["group_id"] in unscorable:
            continue
        trajectory = _trajectory.decode(row["body"])
        if row["judged"] is not None:
            trajectory.metrics = {
                **trajectory.metrics,
                "independent_reward": row["independent_reward"],
                "ruler_score": row["judge_score"],
            }
            trajectory.reward = row["judged"]
        by_group.setdefault(row["group_id"], []).append(trajectory)
    return by_group


async def trained_groups(
    conn: asyncpg.Connection, project: str, model: str, group_ids: Sequence[str]
) -> list[list[Trajectory]]:
    """The groups' trajectories in the order of ``group_ids`` (see ``trained_trajectories`` for
    which are left out)."""
    by_group = await trained_trajectories(conn, project, model, group_ids)
    return [by_group[gid] for gid in group_ids if gid in by_group]
