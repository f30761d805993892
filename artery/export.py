"""``artery export``: a model's stored trajectories, with rewards, verdicts and sampled tokens,
as Parquet, JSON lines or a Hugging Face ``datasets`` dataset, one row per trajectory.

Nested values (messages, tools, metrics, metadata) are JSON text, so every row has the same
columns whatever the agent logged; sampled tokens are flat lists over the trajectory's assistant
messages, in order. The three formats carry the same columns with the same types: ``hf`` is a
directory written by ``Dataset.save_to_disk`` (read it with ``datasets.load_from_disk``), its
features taken from the Parquet schema.
"""

from __future__ import annotations

import json
from pathlib import Path

import asyncpg

FORMATS = ("parquet", "jsonl", "hf")
QUERY = """
SELECT t.project, t.model, t.group_id, t.idx, g.step, g.split, t.reward, g.reward_mean AS group_reward_mean,
       g.submitted_at, g.stored_at, t.body,
       gr.judge_model, r.judge_score, r.independent_reward, r.explanation, gr.error AS judge_error,
       gr.cost_usd AS group_judge_cost_usd
FROM trajectories t
JOIN trajectory_groups g ON g.project = t.project AND g.model = t.model AND g.id = t.group_id
LEFT JOIN group_rewards gr ON gr.project = t.project AND gr.model = t.model AND gr.group_id = t.group_id
LEFT JOIN trajectory_rewards r
  ON r.project = t.project AND r.model = t.model AND r.group_id = t.group_id AND r.idx = t.idx
WHERE t.project = $1 AND t.model = $2
ORDER BY g.stored_at, t.group_id, t.idx
"""
COLUMNS = (
    "project", "model", "group_id", "idx", "step", "split", "reward", "group_reward_mean",
    "submitted_at", "stored_at", "messages", "tools", "metrics", "metadata",
    "sampled_token_ids", "sampled_logprobs", "served_models",
    "judge_model", "judge_score", "independent_reward", "explanation", "judge_error", "group_judge_cost_usd",
)  # fmt: skip


def row_of(record: asyncpg.Record) -> dict:
    body = record["body"]
    if isinstance(body, str | bytes):
        body = json.loads(body)
    samples = [m["sample"] for m in body.get("messages", []) if m.get("sample")]
    row = {k: record[k] for k in record.keys() if k != "body"}
    row.update(
        submitted_at=row["submitted_at"].isoformat(),
        stored_at=row["stored_at"].isoformat(),
        messages=json.dumps(body.get("messages", [])),
        tools=json.dumps(body.get("tools")),
        metrics=json.dumps(body.get("metrics", {})),
        metadata=json.dumps(body.get("metadata", {})),
        sampled_token_ids=[t for s in samples for t in s.get("token_ids", [])],
        sampled_logprobs=[float(x) for s in samples for x in s.get("logprobs", [])],
        served_models=[s.get("served_model") or "" for s in samples],
    )
    return {column: row[column] for column in COLUMNS}


async def fetch_rows(database_url: str, project: str, model: str) -> list[dict]:
    conn = await asyncpg.connect(database_url)
    try:
        return [row_of(r) for r in await conn.fetch(QUERY, project, model)]
    finally:
        await conn.close()


def arrow_schema():
    import pyarrow as pa

    return pa.schema(
        [
            *(pa.field(c, pa.string()) for c in ("project", "model", "group_id")),
            pa.field("idx", pa.int32()),
            pa.field("step", pa.int32()),
            pa.field("split", pa.string()),
            pa.field("reward", pa.float64()),
            pa.field("group_reward_mean", pa.float64()),
            *(pa.field(c, pa.string()) for c in ("submitted_at", "stored_at", "messages", "tools")),
            *(pa.field(c, pa.string()) for c in ("metrics", "metadata")),
            pa.field("sampled_token_ids", pa.list_(pa.int64())),
            pa.field("sampled_logprobs", pa.list_(pa.float64())),
            pa.field("served_models", pa.list_(pa.string())),
            pa.field("judge_model", pa.string()),
            pa.field("judge_score", pa.float64()),
            pa.field("independent_reward", pa.float64()),
            pa.field("explanation", pa.string()),
            pa.field("judge_error", pa.string()),
            pa.field("group_judge_cost_usd", pa.float64()),
        ]
    )


def write(rows: list[dict], path: Path, fmt: str) -> None:
    if fmt == "jsonl":
        with open(path, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows, schema=arrow_schema()), path)
    elif fmt == "hf":
        try:
            import datasets
        except ImportError as exc:
            raise ImportError("--format hf needs datasets: pip install 'artery[export]'") from exc

        features = datasets.Features.from_arrow_schema(arrow_schema())
        datasets.Dataset.from_list(rows, features=features).save_to_disk(str(path))
    else:
        raise ValueError(f"format {fmt!r}: one of {', '.join(FORMATS)}")
