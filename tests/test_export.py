"""``artery export``: stored trajectories, with verdicts and sampled tokens, read back in pandas."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pandas as pd
import pytest

from artery import export
from artery.shared import bus, subjects
from tests.factories import group


async def wait_for_rows(db, count: int) -> None:
    for _ in range(400):
        if await db.fetchval("SELECT count(*) FROM trajectories") >= count:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("groups not stored")


def read_back(path, fmt: str) -> pd.DataFrame:
    if fmt == "hf":  # a Hugging Face datasets directory, with the Parquet schema's types
        import datasets

        dataset = datasets.load_from_disk(str(path))
        assert dataset.features["sampled_token_ids"].feature.dtype == "int64"
        assert dataset.features["judge_score"].dtype == "float64"
        return dataset.to_pandas()
    return pd.read_parquet(path) if fmt == "parquet" else pd.read_json(path, lines=True)


@pytest.mark.parametrize("fmt", export.FORMATS)
async def test_export_reads_back_with_every_column(js, db, database_url, run_collector, tmp_path, fmt):
    await run_collector()
    judged, plain = group("exp", "m", size=3, seed=1, step=2), group("exp", "m", size=2, seed=2, step=3)
    await bus.publish_until_acked(
        js, [bus.prepare(subjects.trajectories("exp", "m"), g) for g in (judged, plain)]
    )
    await bus.publish_until_acked(
        js, [bus.prepare(subjects.trajectories("exp", "other"), group("exp", "other"))]
    )
    await wait_for_rows(db, 9)
    # A RULER verdict for the first group, as the reward service stores it.
    await db.execute(
        "INSERT INTO group_rewards (project, model, group_id, judge_model, attempts, cost_usd)"
        " VALUES ('exp', 'm', $1, 'openai/o3', 1, 0.01)",
        judged.id,
    )
    for idx in range(3):
        await db.execute(
            "INSERT INTO trajectory_rewards (project, model, group_id, idx, reward, judge_score,"
            " independent_reward, explanation) VALUES ('exp', 'm', $1, $2, $3, $3, 0.5, $4)",
            judged.id,
            idx,
            idx / 3,
            f"answer {idx}",
        )

    out = tmp_path / f"exp.{fmt}"
    env = {**os.environ, "ARTERY_DATABASE_URL": database_url, "ARTERY_NATS_URL": "nats://127.0.0.1:1"}
    run = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "artery.ops.cli", "export", "--project", "exp", "--model", "m",
         "--format", fmt, "--output", str(out)],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "5 trajectories of exp/m" in run.stdout

    frame = read_back(out, fmt)
    assert list(frame.columns) == list(export.COLUMNS)
    assert len(frame) == 5 and set(frame.group_id) == {judged.id, plain.id}
    first = frame[(frame.group_id == judged.id) & (frame.idx == 1)].iloc[0]
    source = judged.trajectories[1]
    assert first.step == 2 and first.split == "train" and first.reward == pytest.approx(source.reward)
    assert first.judge_model == "openai/o3" and first.explanation == "answer 1"
    assert first.judge_score == pytest.approx(1 / 3) and first.independent_reward == 0.5
    sampled = [m.sample for m in source.messages if m.sample]
    assert list(first.sampled_token_ids) == [t for s in sampled for t in s.token_ids]
    assert list(first.sampled_logprobs) == pytest.approx([x for s in sampled for x in s.logprobs])
    messages = json.loads(first.messages)
    assert [m["role"] for m in messages] == [m.role for m in source.messages]
    assert json.loads(first.metrics) == {"turns": 5}
    unjudged = frame[frame.group_id == plain.id].iloc[0]
    assert (pd.isna(unjudged.judge_score) and unjudged.judge_model is None) or pd.isna(unjudged.judge_model)
