"""The ``checkpoints`` table: one row per published step, written idempotently.

A row is keyed on (project, model, step) and on the ``checkpoint.saved`` event id, so a
redelivered event never writes twice. ``published_at`` and ``deleted_at`` record which events
have gone out, so a redelivery re-sends only what a crash may have cut short.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass

import asyncpg
import msgspec

_COLUMNS = (
    "project, model, step, event_id, object_name, sha256, size_bytes, base_model, metrics,"
    " saved_at, published_at, deleted_at"
)

_INSERT = """
INSERT INTO checkpoints (project, model, step, event_id, object_name, sha256, size_bytes, base_model,
    metrics, saved_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)
ON CONFLICT DO NOTHING
"""

_INSERT_MODEL = """
INSERT INTO models (project, name, base_model) VALUES ($1, $2, $3)
ON CONFLICT (project, name) DO UPDATE SET base_model = EXCLUDED.base_model
WHERE models.base_model IS NULL
"""


@dataclass(frozen=True, slots=True)
class CheckpointRow:
    project: str
    model: str
    step: int
    event_id: str
    object_name: str
    sha256: str
    size_bytes: int
    base_model: str
    metrics: dict[str, float]
    saved_at: dt.datetime
    published_at: dt.datetime | None = None
    deleted_at: dt.datetime | None = None

    @classmethod
    def of(cls, record: asyncpg.Record) -> CheckpointRow:
        metrics = record["metrics"]
        if isinstance(metrics, (str, bytes)):  # a connection without the jsonb codec
            metrics = json.loads(metrics)
        return cls(**{**dict(record), "metrics": metrics})


async def insert(conn: asyncpg.Connection, row: CheckpointRow) -> bool:
    """Store the row (and register the model); False when it, or its event id, was there already."""
    async with conn.transaction():
        await conn.execute(_INSERT_MODEL, row.project, row.model, row.base_model)
        status = await conn.execute(
            _INSERT,
            row.project,
            row.model,
            row.step,
            row.event_id,
            row.object_name,
            row.sha256,
            row.size_bytes,
            row.base_model,
            msgspec.json.encode(row.metrics),
            row.saved_at,
        )
    return status == "INSERT 0 1"


async def find(
    conn: asyncpg.Connection, project: str, model: str, step: int, event_id: str
) -> list[CheckpointRow]:
    """The rows at this step or written by this event (normally at most one)."""
    records = await conn.fetch(
        f"SELECT {_COLUMNS} FROM checkpoints"
        " WHERE (project = $1 AND model = $2 AND step = $3) OR event_id = $4",
        project,
        model,
        step,
        event_id,
    )
    return [CheckpointRow.of(r) for r in records]


async def live(conn: asyncpg.Connection, project: str, model: str) -> list[CheckpointRow]:
    """The model's checkpoints whose adapters are still in the Object Store, by step."""
    records = await conn.fetch(
        f"SELECT {_COLUMNS} FROM checkpoints"
        " WHERE project = $1 AND model = $2 AND deleted_at IS NULL ORDER BY step",
        project,
        model,
    )
    return [CheckpointRow.of(r) for r in records]


async def newest_step(conn: asyncpg.Connection, project: str, model: str) -> int:
    """The newest step recorded for the model (deleted since or not); 0 when none is."""
    newest = await conn.fetchval(
        "SELECT max(step) FROM checkpoints WHERE project = $1 AND model = $2", project, model
    )
    return int(newest or 0)


async def lock_model(conn: asyncpg.Connection, project: str, model: str) -> None:
    """Serialise retention of one model across publisher replicas, until the transaction ends."""
    await conn.execute("SELECT pg_advisory_xact_lock(hashtextextended($1, 0))", f"ckpt/{project}/{model}")


async def mark_published(conn: asyncpg.Connection, project: str, model: str, step: int) -> None:
    await conn.execute(
        "UPDATE checkpoints SET published_at = now()"
        " WHERE project = $1 AND model = $2 AND step = $3 AND published_at IS NULL",
        project,
        model,
        step,
    )


async def mark_deleted(conn: asyncpg.Connection, project: str, model: str, step: int, reason: str) -> None:
    await conn.execute(
        "UPDATE checkpoints SET deleted_at = now(), deleted_reason = $4"
        " WHERE project = $1 AND model = $2 AND step = $3 AND deleted_at IS NULL",
        project,
        model,
        step,
        reason,
    )
