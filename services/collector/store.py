"""Writing groups and trajectories to PostgreSQL, idempotently, a batch per transaction."""

from __future__ import annotations

import datetime as dt
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import asyncpg
import msgspec

from artery.schemas import TrajectoryGroupSubmitted

_encode = msgspec.json.Encoder().encode


# One statement for the whole batch: arrays in, the keys that were new out. ON CONFLICT makes a
# redelivered group a no-op, and RETURNING tells us which trajectories still need writing.
# A group's key is (project, model, id): ids are the agents' own (0006_tenant_keys.sql).
_INSERT_GROUPS = """
INSERT INTO trajectory_groups (id, project, model, step, split, num_trajectories, num_exceptions,
    reward_mean, needs_reward, submitted_at, stream_seq, metadata, metrics, exceptions, logs,
    reward_spec, body_sha256)
SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::int[], $5::text[], $6::int[],
    $7::int[], $8::float8[], $9::bool[], $10::timestamptz[], $11::bigint[], $12::json[],
    $13::json[], $14::json[], $15::json[], $16::json[], $17::text[])
ON CONFLICT (project, model, id) DO NOTHING
RETURNING project, model, id
"""

#: What was stored under keys that were not new: a redelivery has the same body hash.
_STORED_HASHES = """
SELECT g.project, g.model, g.id, g.body_sha256 FROM trajectory_groups g
JOIN unnest($1::text[], $2::text[], $3::text[]) AS k(project, model, id)
    ON g.project = k.project AND g.model = k.model AND g.id = k.id
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
    #: Of the message as it was published: tells a redelivery from another group under its id.
    body_sha256: str
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

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.project, self.model, self.id)

    @classmethod
    def of(
        cls, group: TrajectoryGroupSubmitted, stream_seq: int | None, body: bytes | None = None
    ) -> StoredGroup:
        """``body`` is the message as published (its JSON encoding when not given)."""
        return cls(
            id=group.id,
            project=group.project,
            model=group.model,
            body_sha256=hashlib.sha256(_encode(group) if body is None else body).hexdigest(),
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


async def write_groups(conn: asyncpg.Connection, batch: Sequence[StoredGroup]) -> dict[int, str]:
    """Store the batch in one transaction. Return the conflicts: for each position in ``batch``
    whose key was already taken by a different body, the stored body's hash. Every other group
    is stored now or was before (a redelivery)."""
    first: dict[tuple[str, str, str], StoredGroup] = {}
    for item in batch:  # the same key twice in one batch: the first is the one stored
        first.setdefault(item.key, item)
    groups = list(first.values())
    if not groups:
        return {}
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
        [g.body_sha256 for g in groups],
    )
    async with conn.transaction():
        models = sorted({(g.project, g.model) for g in groups})
        await conn.execute(_INSERT_MODELS, [p for p, _ in models], [m for _, m in models])
        new = {(r["project"], r["model"], r["id"]) for r in await conn.fetch(_INSERT_GROUPS, *columns)}
        records = [
            (g.project, g.model, g.id, idx, reward, body)
            for g in groups
            if g.key in new
            for idx, (reward, body) in enumerate(zip(g.rewards, g.bodies, strict=True))
        ]
        if records:
            # COPY is the fastest path in; safe because these groups are new in this transaction.
            await conn.copy_records_to_table(
                "trajectories",
                records=records,
                columns=("project", "model", "group_id", "idx", "reward", "body"),
            )
        old = [g for g in groups if g.key not in new]
        stored = {g.key: g.body_sha256 for g in groups if g.key in new}
        if old:
            rows = await conn.fetch(
                _STORED_HASHES, [g.project for g in old], [g.model for g in old], [g.id for g in old]
            )
            stored.update({(r["project"], r["model"], r["id"]): r["body_sha256"] for r in rows})
    # A group stored before hashes were kept (NULL) cannot be told apart: taken as a redelivery.
    return {
        i: stored[item.key]
        for i, item in enumerate(batch)
        if stored.get(item.key) is not None and stored[item.key] != item.body_sha256
    }
