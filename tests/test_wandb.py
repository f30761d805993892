"""W&B: ``report_metrics=["wandb"]`` sends what ``model.log`` / ``model.train`` write to
``history.jsonl`` to a W&B run; checked on a real offline run (``WANDB_MODE=offline``) by reading
its ``.wandb`` file back (LevelDB log records of W&B's own protobuf ``Record``)."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

wandb = pytest.importorskip("wandb", reason="the wandb extra: pip install -e '.[wandb]'")

import artery as art  # noqa: E402
from artery.backend import TrainResult  # noqa: E402
from artery.integrations import wandb as wandb_integration  # noqa: E402

pytestmark = pytest.mark.timeout(180)


class FakeBackend:
    """Just enough backend for ``log`` and ``train``: the W&B path is what is under test here (the
    real services' training is covered elsewhere)."""

    def __init__(self) -> None:
        self.step = 0
        self.published: list[str] = []

    async def publish(self, model, groups, *, split="train"):
        self.published.append(split)
        return [f"g{i}" for i, _ in enumerate(groups)]

    async def _get_step(self, model) -> int:
        return self.step

    async def train(self, model, groups, config=None, **kwargs) -> TrainResult:
        self.step += 1
        return TrainResult(step=self.step, metrics={"loss": 0.25, "reward_mean": 0.5, "grad_norm": 1.5})


def group(*rewards: float) -> art.TrajectoryGroup:
    return art.TrajectoryGroup(
        [
            art.Trajectory(
                messages_and_choices=[
                    {"role": "user", "content": "2+2?"},
                    {"role": "assistant", "content": f"answer {r}"},
                ],
                reward=r,
                metrics={"turns": 1},
                metadata={"r": r},
            )
            for r in rewards
        ]
    )


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_DIR", "WANDB_API_KEY", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    yield
    wandb.teardown()  # W&B's service process goes with the test (the suite fails on leftovers)


# --------------------------------------------------------------------------- reading the run back


def read_records(path: Path) -> list:
    """Every ``Record`` of a ``.wandb`` file: W&B's header (``:W&B``, magic, version), then the
    LevelDB log format (32 KiB blocks; 7-byte record headers: crc, length, type)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    records, pending, offset, block = [], b"", 7, 32768
    while offset + 7 <= len(data):
        room = block - offset % block
        if room < 7:  # the block's trailer
            offset += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[offset : offset + 7])
        if length == 0 and kind == 0:  # zero padding: the rest of the block
            offset += room
            continue
        payload = data[offset + 7 : offset + 7 + length]
        offset += 7 + length
        if kind == 1:  # FULL
            pending, whole = b"", payload
        elif kind == 2:  # FIRST
            pending, whole = payload, None
        elif kind == 3:  # MIDDLE
            pending, whole = pending + payload, None
        else:  # LAST
            pending, whole = b"", pending + payload
        if whole is not None:
            record = wandb_internal_pb2.Record()
            record.ParseFromString(whole)
            records.append(record)
    return records


def items_of(items) -> dict:
    """W&B's items (``key``, or ``nested_key`` for a value inside a dict) as one dict."""
    out: dict = {}
    for item in items:
        *parents, last = list(item.nested_key) or [item.key]
        into = out
        for parent in parents:
            into = into.setdefault(parent, {})
        into[last] = json.loads(item.value_json)
    return out


def history_rows(records) -> list[dict]:
    return [items_of(r.history.item) for r in records if r.WhichOneof("record_type") == "history"]


def summary_of(records) -> dict:
    summary: dict = {}
    for record in records:
        if record.WhichOneof("record_type") == "summary":
            summary.update(items_of(record.summary.update))
    return summary


# --------------------------------------------------------------------------- tests


async def test_log_and_train_go_to_an_offline_wandb_run_with_rewards_and_tables(tmp_path, offline_wandb):
    model = art.TrainableModel(
        name="tracked",
        project="wandb-test",
        base_model="tiny",
        base_path=str(tmp_path / "art"),
        report_metrics=["wandb"],
        config={"task": "adding"},
    )
    model._backend = FakeBackend()
    try:
        await model.log([group(0.0, 1.0)], split="val")  # step 0: val/reward 0.5
        result = await model.train([group(0.25, 0.75), group(1.0, 1.0)])  # step 1
        assert result.step == 1
        await model.log([group(1.0, 1.0)], split="val", metrics={"costs/usd": 0.01})  # step 1: val/reward 1.0
        run = model._wandb_run
        assert (run.project, run.name, run.id) == ("wandb-test", "tracked", "tracked")
    finally:
        wandb_integration.finish(model)
        wandb.teardown()  # the service writes out the run and exits

    history = [json.loads(line) for line in (model.directory / "history.jsonl").read_text().splitlines()]
    (run_file,) = (model.directory / "wandb").glob("offline-run-*/run-tracked.wandb")
    records = read_records(run_file)
    rows = history_rows(records)
    assert len(rows) == 3 == len(history)

    # Every metric of every history.jsonl row is in the run, at the same step.
    for row, logged in zip(history, rows, strict=True):
        assert logged["training_step"] == row["step"]
        for key, value in row.items():
            if key not in ("step", "recorded_at"):
                assert logged[key] == pytest.approx(value), key
    assert [r.get("val/reward") for r in rows] == [0.5, None, 1.0]
    assert rows[1]["train/reward"] == pytest.approx(0.75) and rows[1]["train/loss"] == 0.25
    assert rows[1]["train/reward_std_dev"] == pytest.approx(0.125)
    assert rows[2]["costs/usd"] == 0.01

    # The trajectories as tables, one per logged split and step.
    assert rows[0]["val/trajectories"]["_type"] == "table-file" and rows[0]["val/trajectories"]["nrows"] == 2
    assert rows[1]["train/trajectories"]["nrows"] == 4
    first = json.loads((run_file.parent / "files" / rows[0]["val/trajectories"]["path"]).read_text())
    assert first["columns"] == wandb_integration.TABLE_COLUMNS
    assert [r[4] for r in first["data"]] == [0.0, 1.0]
    assert json.loads(first["data"][1][5]) == [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "answer 1.0"},
    ]

    # The summary holds the last values; the config the model's.
    summary = summary_of(records)
    assert summary["val/reward"] == 1.0 and summary["training_step"] == 1
    config = {}
    for record in records:  # the run record carries the config from wandb.init; config records changes
        kind = record.WhichOneof("record_type")
        if kind in ("run", "config"):
            config.update(items_of((record.run.config if kind == "run" else record.config).update))
    assert config["base_model"] == "tiny" and config["config"] == {"task": "adding"}


def test_who_reports_to_wandb(monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    unset = art.Model(name="a", project="p")
    assert not wandb_integration.wanted(unset)
    assert wandb_integration.wanted(art.Model(name="a", project="p", report_metrics=["wandb"]))
    assert not wandb_integration.wanted(art.Model(name="a", project="p", report_metrics=[]))
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_integration.wanted(unset)  # as ART: the key alone turns it on
    assert not wandb_integration.wanted(art.Model(name="a", project="p", report_metrics=[]))


def test_without_the_extra_asking_for_wandb_names_it(tmp_path):
    code = f"""
import asyncio, sys
sys.modules["wandb"] = None
import artery as art
model = art.Model(name="a", project="p", base_path={str(tmp_path)!r}, report_metrics=["wandb"])
try:
    asyncio.run(model.log(metrics={{"x": 1.0}}, step=0))
except ImportError as e:
    print(e)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "pip install 'artery[wandb]'" in out.stdout, out.stdout + out.stderr
