"""What the reward service reads from and writes to PostgreSQL."""

from __future__ import annotations

from dataclasses import dataclass

import asyncpg
import msgspec

from artery.schemas import RewardSpec, Trajectory

_trajectory = msgspec.json.Decoder(Trajectory)
_spec = msgspec.json.Decoder(RewardSpec | None)


@dataclass(frozen=True)
class GroupToScore:
    group_id: str
    spec: RewardSpec | None
    trajectories: list[Trajectory]


@dataclass(frozen=True)
class Verdict:
    """A stored outcome: scores (with the usage that bought them), or the error that stopped them."""

    judge_model: str
    error: str | None
    attempts: int
    prompt_tokens: int
    completion_tokens: int
    cost_usd: float | None
    #: (index, reward, judge score, independent reward, explanation), by index.
    rows: list[tuple[int, float, float, float, str]]


#: (project, model, group id): group ids are the agents' own, unique only within a model.
GroupKey = tuple[str, str, str]


async def load_group(conn: asyncpg.Connection, key: GroupKey) -> GroupToScore | None:
    group_id = key[2]
    spec = await conn.fetchval(
        "SELECT reward_spec::text FROM trajectory_groups WHERE project = $1 AND model = $2 AND id = $3", *key
    )
    rows = await conn.fetch(
        "SELECT body::text AS body FROM trajectories"
        " WHERE project = $1 AND model = $2 AND group_id = $3 ORDER BY idx",
        *key,
    )
    if not rows:
        return None
    return GroupToScore(
        group_id=group_id,
        spec=_spec.decode(spec) if spec else None,
        trajectories=[_trajectory.decode(r["body"]) for r in rows],
    )


_OF_GROUP = "project = $1 AND model = $2 AND group_id = $3"


async def stored_verdict(conn: asyncpg.Connection, key: GroupKey) -> Verdict | None:
    head = await conn.fetchrow(f"SELECT * FROM group_rewards WHERE {_OF_GROUP}", *key)
    if head is None:
        return None
    rows = await conn.fetch(
        "SELECT idx, reward, judge_score, independent_reward, explanation FROM trajectory_rewards"
        f" WHERE {_OF_GROUP} ORDER BY idx",
        *key,
    )
    return Verdict(
        judge_model=head["judge_model"],
        error=head["error"],
        attempts=head["attempts"],
        prompt_tokens=head["prompt_tokens"],
        completion_tokens=head["completion_tokens"],
        cost_usd=head["cost_usd"],
        rows=[tuple(r) for r in rows],
    )


def _text(value: str | None) -> str | None:
    """For a text column, which cannot hold U+0000: a judge's answer (quoted in an error or an
    explanation) can contain one, and the rubric is an agent's. Failing on it would fail every
    redelivery until the group is poison. The agent's own rubric stays exact in ``reward_spec``."""
    return value.replace("\x00", "\ufffd") if value and "\x00" in value else value


async def record_verdict(
    conn: asyncpg.Connection, key: GroupKey, verdict: Verdict, rubric: str | None
) -> Verdict:
    """Store ``verdict`` unless one is already there (a redelivery, or another replica won the
    race); return the one that is stored, so every replica announces the same rewards."""
    async with conn.transaction():
        inserted = await conn.fetchval(
            "INSERT INTO group_rewards (project, model, group_id, judge_model, rubric, error, attempts,"
            " prompt_tokens, completion_tokens, cost_usd) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)"
            " ON CONFLICT (project, model, group_id) DO NOTHING RETURNING group_id",
            *key,
            _text(verdict.judge_model),
            _text(rubric),
            _text(verdict.error),
            verdict.attempts,
            verdict.prompt_tokens,
            verdict.completion_tokens,
            verdict.cost_usd,
        )
        if inserted is None:
            stored = await stored_verdict(conn, key)
            assert stored is not None  # the conflicting row is committed: we saw it conflict
            return stored
        if verdict.rows:
            await conn.executemany(
                "INSERT INTO trajectory_rewards (project, model, group_id, idx, reward, judge_score,"
                " independent_reward, explanation) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
                [(*key, *row[:4], _text(row[4])) for row in verdict.rows],
            )
    return verdict
