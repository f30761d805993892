"""What the console reads from PostgreSQL: read-only queries, one function per view.

Each returns plain dicts (JSON-ready) so that pages and the JSON API share them.
"""

from __future__ import annotations

import math

import asyncpg

MODELS = """
SELECT m.project, m.name, m.base_model,
       (SELECT max(s.step) FROM training_steps s WHERE s.project = m.project AND s.model = m.name)
           AS last_step,
       (SELECT count(*) FROM trajectory_groups g WHERE g.project = m.project AND g.model = m.name)
           AS groups
FROM models m ORDER BY m.project, m.name
"""

# Per step: the trainer's metrics, with the min/max reward of the trajectories it trained on.
STEPS = """
SELECT s.step, s.trained, s.metrics, s.completed_at,
       (SELECT min(t.reward) FROM trajectories t
         WHERE t.project = s.project AND t.model = s.model AND t.group_id = ANY (s.group_ids))
           AS reward_min,
       (SELECT max(t.reward) FROM trajectories t
         WHERE t.project = s.project AND t.model = s.model AND t.group_id = ANY (s.group_ids))
           AS reward_max
FROM training_steps s WHERE s.project = $1 AND s.model = $2 ORDER BY s.step
"""

# Validation groups (``model.log(..., split="val")``), by the step they were sampled at.
VAL = """
SELECT step, avg(reward_mean) AS reward_mean FROM trajectory_groups
WHERE project = $1 AND model = $2 AND split = 'val' AND step IS NOT NULL
GROUP BY step ORDER BY step
"""

JUDGE_COST = """
SELECT g.step, sum(r.cost_usd) AS cost_usd, sum(r.prompt_tokens + r.completion_tokens) AS tokens
FROM group_rewards r JOIN trajectory_groups g
  ON g.project = r.project AND g.model = r.model AND g.id = r.group_id
WHERE r.project = $1 AND r.model = $2 GROUP BY g.step ORDER BY g.step
"""

TRAJECTORIES = """
SELECT t.group_id, t.idx, t.reward, g.step, g.split, g.stored_at,
       -- json keeps \\u0000 (a sampled NUL token), which json operators refuse to read: as
       -- \\ufffd (same length, a valid escape whatever precedes it) the count always works
       json_array_length(replace(t.body::text, '\\u0000', '\\ufffd')::json -> 'messages') AS messages,
       r.explanation IS NOT NULL AS judged
FROM trajectories t
JOIN trajectory_groups g ON g.project = t.project AND g.model = t.model AND g.id = t.group_id
LEFT JOIN trajectory_rewards r
  ON r.project = t.project AND r.model = t.model AND r.group_id = t.group_id AND r.idx = t.idx
WHERE t.project = $1 AND t.model = $2
  AND ($3::int IS NULL OR g.step = $3)
  AND ($4::float8 IS NULL OR t.reward >= $4)
  AND ($5::float8 IS NULL OR t.reward <= $5)
  AND ($6::text IS NULL OR t.group_id = $6)
ORDER BY g.stored_at DESC, t.group_id, t.idx
LIMIT $7
"""

TRAJECTORY = """
SELECT t.group_id, t.idx, t.reward, t.body, g.step, g.split, g.stored_at, g.reward_spec,
       r.judge_score, r.independent_reward, r.explanation, gr.judge_model, gr.error AS judge_error
FROM trajectories t
JOIN trajectory_groups g ON g.project = t.project AND g.model = t.model AND g.id = t.group_id
LEFT JOIN trajectory_rewards r
  ON r.project = t.project AND r.model = t.model AND r.group_id = t.group_id AND r.idx = t.idx
LEFT JOIN group_rewards gr
  ON gr.project = t.project AND gr.model = t.model AND gr.group_id = t.group_id
WHERE t.project = $1 AND t.model = $2 AND t.group_id = $3 AND t.idx = $4
"""


def _finite(value):
    return value if isinstance(value, int | float) and math.isfinite(value) else None


async def models(conn: asyncpg.Connection) -> list[dict]:
    return [dict(row) for row in await conn.fetch(MODELS)]


async def steps(conn: asyncpg.Connection, project: str, model: str) -> list[dict]:
    """One row per training step: ``step``, ``reward_min``/``reward_max`` and every numeric metric
    the trainer recorded (``reward_mean``, ``loss``, ``offpolicy/*``...)."""
    rows = []
    for row in await conn.fetch(STEPS, project, model):
        metrics = {k: _finite(v) for k, v in (row["metrics"] or {}).items() if _finite(v) is not None}
        rows.append(
            {
                **metrics,
                "step": row["step"],
                "trained": row["trained"],
                "completed_at": row["completed_at"].isoformat(),
                "reward_min": _finite(row["reward_min"]),
                "reward_max": _finite(row["reward_max"]),
            }
        )
    return rows


async def val_curve(conn: asyncpg.Connection, project: str, model: str) -> list[dict]:
    return [dict(row) for row in await conn.fetch(VAL, project, model)]


async def judge_cost(conn: asyncpg.Connection, project: str, model: str) -> list[dict]:
    return [dict(row) for row in await conn.fetch(JUDGE_COST, project, model)]


async def trajectories(
    conn: asyncpg.Connection,
    project: str,
    model: str,
    *,
    step: int | None = None,
    min_reward: float | None = None,
    max_reward: float | None = None,
    group_id: str | None = None,
    limit: int = 50,
) -> list[dict]:
    rows = await conn.fetch(TRAJECTORIES, project, model, step, min_reward, max_reward, group_id, limit)
    return [dict(row) for row in rows]


async def trajectory(
    conn: asyncpg.Connection, project: str, model: str, group_id: str, idx: int
) -> dict | None:
    row = await conn.fetchrow(TRAJECTORY, project, model, group_id, idx)
    return dict(row) if row is not None else None
