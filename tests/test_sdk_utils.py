"""The SDK's helpers for training scripts, ART's shape: ``trajectory_group_batches``,
``art.utils.iterate_dataset`` / ``limit_concurrency``, and the trajectory Parquet files that
``model.log`` writes. Pure: no servers."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import random
import warnings
from typing import Any

import pytest

import artery as art
from artery.batches import trajectory_group_batches
from artery.gather import TooManyExceptions
from artery.parquet import read_trajectory_groups_parquet, write_trajectory_groups_parquet
from artery.utils import DatasetBatch, iterate_dataset, limit_concurrency

try:  # the `log` extra (in `dev`): only the Parquet tests need it
    import pyarrow as pa
    import pyarrow.parquet as pq
except ImportError:  # pragma: no cover
    pa = pq = None
needs_pyarrow = pytest.mark.skipif(pa is None, reason="pyarrow is not installed (the `log` extra)")


# --- trajectory_group_batches -----------------------------------------------------------------


class Gauge:
    """How many groups are running now, and the most at once."""

    def __init__(self):
        self.now = 0
        self.peak = 0
        self.started: list[int] = []


def groups_of(
    gauge: Gauge, n: int, *, rollouts: int = 2, fail=frozenset(), failing: int = 2, delay: float = 0.002
):
    """``n`` lazily created groups; in the groups of ``fail``, the first ``failing`` rollouts raise."""

    async def rollout(i: int, j: int) -> art.Trajectory:
        await asyncio.sleep(delay * ((i * 7 + j) % 3 + 1))
        if i in fail and j < failing:
            raise RuntimeError(f"rollout {i}.{j} failed")
        return art.Trajectory(reward=float(i), metrics={"group": i})

    async def group(i: int) -> art.TrajectoryGroup:
        gauge.started.append(i)
        gauge.now += 1
        gauge.peak = max(gauge.peak, gauge.now)
        try:
            return await art.TrajectoryGroup(rollout(i, j) for j in range(rollouts))
        finally:
            gauge.now -= 1

    return (group(i) for i in range(n))  # lazy, as ART users write it


async def test_batches_have_batch_size_groups_and_the_last_one_the_rest():
    gauge = Gauge()
    batches = [b async for b in trajectory_group_batches(groups_of(gauge, 10), batch_size=4)]
    assert [len(b) for b in batches] == [4, 4, 2]
    assert sorted(int(g.trajectories[0].reward) for b in batches for g in b) == list(range(10))
    assert all(isinstance(g, art.TrajectoryGroup) and len(g) == 2 for b in batches for g in b)


@pytest.mark.parametrize(("batch_size", "max_concurrent_batches"), [(2, 1), (3, 2), (1, 4)])
async def test_at_most_batch_size_times_max_concurrent_batches_groups_run_at_once(
    batch_size, max_concurrent_batches
):
    gauge = Gauge()
    count = 0
    async for batch in trajectory_group_batches(
        groups_of(gauge, 20),
        batch_size=batch_size,
        max_concurrent_batches=max_concurrent_batches,
    ):
        count += len(batch)
        await asyncio.sleep(0.005)  # "training": the next batches' rollouts keep running meanwhile
    assert count == 20
    assert gauge.peak == batch_size * max_concurrent_batches


async def test_groups_are_started_lazily_while_the_consumer_trains():
    gauge = Gauge()
    seen_before_first = None
    async for _ in trajectory_group_batches(groups_of(gauge, 30), batch_size=2, max_concurrent_batches=2):
        if seen_before_first is None:
            seen_before_first = len(gauge.started)
    assert seen_before_first is not None and seen_before_first <= 4 + 2  # not all 30 at once
    assert len(gauge.started) == 30


async def test_skip_batches_skips_groups_without_running_them():
    gauge = Gauge()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a skipped coroutine is closed, not un-awaited
        batches = [
            b async for b in trajectory_group_batches(groups_of(gauge, 10), batch_size=3, skip_batches=2)
        ]
    assert sorted(gauge.started) == [6, 7, 8, 9]
    assert [len(b) for b in batches] == [3, 1]
    assert sorted(int(g.trajectories[0].reward) for b in batches for g in b) == [6, 7, 8, 9]


async def test_rollout_exceptions_are_counted_per_batch_and_kept_in_the_group():
    gauge = Gauge()
    # Group 1 loses both rollouts: 2 exceptions, allowed by max_batch_exceptions=2.
    batches = [
        b
        async for b in trajectory_group_batches(
            groups_of(gauge, 4, fail={1}), batch_size=2, max_batch_exceptions=2, max_concurrent_batches=1
        )
    ]
    groups = [g for b in batches for g in b]
    failed = [g for g in groups if g.exceptions]
    assert len(failed) == 1 and len(failed[0]) == 0 and len(failed[0].exceptions) == 2
    assert failed[0].exceptions[0].type == "RuntimeError"


async def test_more_exceptions_in_a_batch_than_allowed_raise_and_stop_the_rest():
    gauge = Gauge()
    with pytest.raises(TooManyExceptions):
        async for _ in trajectory_group_batches(
            groups_of(gauge, 12, fail={0, 1}), batch_size=2, max_batch_exceptions=1
        ):
            pass
    await asyncio.sleep(0.02)
    assert gauge.now == 0  # every group still running was cancelled


async def test_the_exception_budget_starts_again_with_each_batch():
    """One failing rollout per batch, three in all: max_batch_exceptions=1 lets the run finish."""
    gauge = Gauge()
    batches = [
        b
        async for b in trajectory_group_batches(  # one group at a time: each batch is one window
            groups_of(gauge, 3, fail={0, 1, 2}, failing=1),
            batch_size=1,
            max_batch_exceptions=1,
            max_concurrent_batches=1,
        )
    ]
    assert [len(b[0]) for b in batches] == [1, 1, 1]
    assert sum(len(b[0].exceptions) for b in batches) == 3
    with pytest.raises(TooManyExceptions):  # the same three in one batch are too many
        async for _ in trajectory_group_batches(
            groups_of(Gauge(), 3, fail={0, 1, 2}, failing=1), batch_size=3, max_batch_exceptions=1
        ):
            pass


async def test_a_fraction_is_of_one_batchs_rollouts():
    gauge = Gauge()
    # A batch is 4 groups x 2 rollouts = 8 rollouts; 0.25 of it allows 2 exceptions, not 3.
    ok = [
        b
        async for b in trajectory_group_batches(
            groups_of(gauge, 8, fail={2}), batch_size=4, max_batch_exceptions=0.25, max_concurrent_batches=1
        )
    ]
    assert sum(len(b) for b in ok) == 8
    with pytest.raises(TooManyExceptions):
        async for _ in trajectory_group_batches(
            groups_of(Gauge(), 8, fail={1, 2}),
            batch_size=4,
            max_batch_exceptions=0.25,
            max_concurrent_batches=1,
        ):
            pass


async def test_a_group_awaitable_that_raises_counts_as_one_exception_and_is_left_out():
    async def broken() -> art.TrajectoryGroup:
        raise ValueError("could not load the scenario")

    async def fine(i: int) -> art.TrajectoryGroup:
        return art.TrajectoryGroup([art.Trajectory(reward=float(i))])

    awaitables = [fine(0), broken(), fine(1), fine(2)]
    batches = [b async for b in trajectory_group_batches(awaitables, batch_size=2, max_batch_exceptions=1)]
    assert sorted(g.trajectories[0].reward for b in batches for g in b) == [0.0, 1.0, 2.0]
    with pytest.raises(TooManyExceptions):
        async for _ in trajectory_group_batches([broken(), broken()], batch_size=2, max_batch_exceptions=1):
            pass


async def test_closing_the_generator_early_cancels_the_running_groups():
    gauge = Gauge()
    async with contextlib.aclosing(
        trajectory_group_batches(groups_of(gauge, 40, delay=0.01), batch_size=2)
    ) as batches:
        async for _ in batches:
            break
    assert gauge.now == 0


def test_batches_reject_nonsense_sizes():
    for kwargs in ({"batch_size": 0}, {"batch_size": 1, "max_concurrent_batches": 0}):
        with pytest.raises(ValueError):
            asyncio.run(anext(trajectory_group_batches([], **kwargs)))


# --- iterate_dataset --------------------------------------------------------------------------


def test_iterate_dataset_visits_every_item_once_per_epoch_in_arts_order():
    data = list(range(10))
    batches = list(iterate_dataset(data, groups_per_step=3, num_epochs=2, use_tqdm=False))
    assert [(b.step, b.epoch, b.epoch_step, len(b.items)) for b in batches] == [
        (0, 0, 0, 3), (1, 0, 1, 3), (2, 0, 2, 3), (3, 0, 3, 1),
        (4, 1, 0, 3), (5, 1, 1, 3), (6, 1, 2, 3), (7, 1, 3, 1),
    ]  # fmt: skip
    assert all(b.total_steps == 8 for b in batches)
    for epoch in (0, 1):
        items = [x for b in batches if b.epoch == epoch for x in b.items]
        assert sorted(items) == data
        expected = list(range(10))  # ART: random.seed(epoch); random.shuffle(indices)
        random.Random(epoch).shuffle(expected)
        assert items == expected
    assert [b.items for b in batches[:4]] != [b.items for b in batches[4:]]  # reshuffled per epoch


def test_iterate_dataset_is_the_same_every_time_and_leaves_global_random_alone():
    random.seed(1234)
    state = random.getstate()
    first = [b.items for b in iterate_dataset("abcdefg", groups_per_step=2, num_epochs=3, use_tqdm=False)]
    assert random.getstate() == state
    second = [b.items for b in iterate_dataset("abcdefg", groups_per_step=2, num_epochs=3, use_tqdm=False)]
    assert first == second


@pytest.mark.parametrize("initial_step", [0, 1, 3, 4, 7, 8, 20])
def test_resuming_from_initial_step_gives_exactly_the_remaining_batches(initial_step):
    data = [f"item{i}" for i in range(7)]
    everything = list(iterate_dataset(data, groups_per_step=2, num_epochs=2, use_tqdm=False))
    resumed = list(
        iterate_dataset(data, groups_per_step=2, num_epochs=2, initial_step=initial_step, use_tqdm=False)
    )
    assert resumed == [b for b in everything if b.step >= initial_step]


def test_iterate_dataset_edges_and_progress_bar(capsys):
    assert list(iterate_dataset([], groups_per_step=4)) == []
    with pytest.raises(ValueError):
        list(iterate_dataset([1], groups_per_step=0))
    out = list(iterate_dataset([1, 2, 3], groups_per_step=5, num_epochs=1))  # the bar on stderr
    assert out == [DatasetBatch(items=out[0].items, step=0, epoch=0, epoch_step=0, total_steps=1)]
    assert sorted(out[0].items) == [1, 2, 3]
    assert "Iterating dataset" in capsys.readouterr().err


# --- limit_concurrency ------------------------------------------------------------------------


async def test_limit_concurrency_runs_at_most_n_at_once():
    running = peak = 0

    @limit_concurrency(3)
    async def call(i: int) -> int:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.002)
        running -= 1
        return i * 2

    assert await asyncio.gather(*(call(i) for i in range(20))) == [i * 2 for i in range(20)]
    assert peak == 3
    assert call.__name__ == "call"


async def test_limit_concurrency_is_per_derived_key():
    running: dict[str, int] = {}
    peak: dict[str, int] = {}
    overall = overall_peak = 0

    @limit_concurrency(2, derive_key=lambda host, i: host)
    async def fetch(host: str, i: int) -> None:
        nonlocal overall, overall_peak
        running[host] = running.get(host, 0) + 1
        overall += 1
        peak[host] = max(peak.get(host, 0), running[host])
        overall_peak = max(overall_peak, overall)
        await asyncio.sleep(0.002)
        running[host] -= 1
        overall -= 1

    await asyncio.gather(*(fetch(host, i) for host in ("a", "b", "c") for i in range(8)))
    assert peak == {"a": 2, "b": 2, "c": 2}
    assert overall_peak == 6


def test_limit_concurrency_works_across_event_loops():
    @limit_concurrency(1)
    async def one(i: int) -> int:
        await asyncio.sleep(0.001)
        return i

    async def many():
        return await asyncio.gather(*(one(i) for i in range(3)))

    assert asyncio.run(many()) == [0, 1, 2]
    assert asyncio.run(many()) == [0, 1, 2]  # a semaphore of the first loop would raise here
    with pytest.raises(ValueError):
        limit_concurrency(0)


def test_art_utils_names():
    import artery.utils as utils

    assert utils.retry is art.retry
    assert {"iterate_dataset", "limit_concurrency", "retry", "DatasetBatch"} <= set(utils.__all__)


# --- trajectory Parquet files -----------------------------------------------------------------

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Finds a word's meaning",
            "parameters": {"type": "object", "properties": {"word": {"type": "string"}}},
        },
    }
]


def tool_use_trajectory() -> art.Trajectory:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "lookup", "arguments": '{"word":"ñandú"}'},
    }
    return art.Trajectory(
        messages_and_choices=[
            {"role": "system", "content": "Réponds en français. 日本語も可。"},
            {"role": "user", "content": "What is a ñandú? 🐦"},
            {
                "finish_reason": "tool_calls",
                "index": 0,
                "message": {"role": "assistant", "content": None, "tool_calls": [call]},
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "A large flightless bird — «rhea»."},
            {
                "finish_reason": "stop",
                "index": 0,
                "message": {"role": "assistant", "content": "Un oiseau: le nandou 🐦"},
            },
        ],
        tools=TOOLS,
        reward=0.75,
        initial_policy_version=3,
        final_policy_version=4,
        metrics={"turns": 2, "correct": True, "latency": 1.5},
        metadata={"scenario": "ñandú-1", "notes": None, "difficulty": 2},
        logs=["looked up «ñandú»"],
        additional_histories=[art.History(messages_and_choices=[{"role": "user", "content": "sub-task"}])],
    )


def sample_groups() -> list[art.TrajectoryGroup]:
    return [
        art.TrajectoryGroup(
            [
                tool_use_trajectory(),
                art.Trajectory(messages_and_choices=[{"role": "user", "content": "hi"}], reward=0.0),
            ],
            metadata={"task": "birds"},
            metrics={"judge_seconds": 0.5},
            logs=["group log"],
        ),
        art.TrajectoryGroup([], exceptions=[RuntimeError("every rollout raised")]),
        art.TrajectoryGroup(
            [art.Trajectory(messages_and_choices=[{"role": "user", "content": "x"}], reward=-1.0)]
        ),
    ]


@needs_pyarrow
def test_parquet_has_arts_columns_one_row_per_trajectory(tmp_path):
    path = write_trajectory_groups_parquet(sample_groups(), tmp_path / "0003.parquet")
    table = pq.read_table(path)
    art_columns = [
        "group_index", "group_metadata", "group_metrics", "group_logs", "reward",
        "metrics", "metadata", "tools", "logs", "messages",
    ]  # fmt: skip
    assert table.column_names[: len(art_columns)] == art_columns
    assert table.schema.field("messages").type == pa.list_(
        pa.struct(
            [
                ("role", pa.string()),
                ("content", pa.string()),
                ("tool_calls", pa.string()),
                ("tool_call_id", pa.string()),
                ("trainable", pa.bool_()),
            ]
        )
    )
    assert pq.read_metadata(path).row_group(0).column(0).compression == "ZSTD"
    rows = table.to_pylist()
    assert [(r["group_index"], r["trajectory_index"], r["reward"]) for r in rows] == [
        (0, 0, 0.75), (0, 1, 0.0), (1, None, None), (2, 0, -1.0),
    ]  # fmt: skip
    first = rows[0]
    assert json.loads(first["group_metadata"]) == {"task": "birds"}
    assert first["group_logs"] == ["group log"]
    assert json.loads(first["metrics"]) == {"turns": 2, "correct": True, "latency": 1.5}
    assert json.loads(first["metadata"]) == {"scenario": "ñandú-1", "notes": None, "difficulty": 2}
    assert json.loads(first["tools"]) == TOOLS
    assert [m["role"] for m in first["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
    assert [m["trainable"] for m in first["messages"]] == [False, False, True, False, True]
    assert json.loads(first["messages"][2]["tool_calls"])[0]["function"]["arguments"] == '{"word":"ñandú"}'
    assert first["messages"][3]["tool_call_id"] == "call_1"
    assert first["messages"][4]["content"] == "Un oiseau: le nandou 🐦"
    assert (first["initial_policy_version"], first["final_policy_version"]) == (3, 4)
    second = rows[1]  # empty dicts and lists are nulls, as ART writes them
    assert (second["metrics"], second["metadata"], second["tools"], second["logs"]) == (None,) * 4
    assert json.loads(rows[2]["group_exceptions"])[0]["message"] == "every rollout raised"


@needs_pyarrow
def test_parquet_round_trip(tmp_path):
    groups = sample_groups()
    path = write_trajectory_groups_parquet(groups, tmp_path / "t.parquet")
    back = read_trajectory_groups_parquet(path)
    assert len(back) == 3
    assert [len(g) for g in back] == [2, 0, 1]
    assert back[1].exceptions[0].type == "RuntimeError"
    assert back[0].metadata == {"task": "birds"} and back[0].metrics == {"judge_seconds": 0.5}
    assert back[0].logs == ["group log"]
    original, restored = groups[0].trajectories[0], back[0].trajectories[0]
    for field in (
        "reward",
        "metrics",
        "metadata",
        "logs",
        "tools",
        "initial_policy_version",
        "final_policy_version",
    ):
        assert getattr(restored, field) == getattr(original, field), field
    # Messages come back as OpenAI dicts: the same conversation once both are normalised.
    assert restored.messages() == original.messages()
    assert restored.additional_histories[0].messages_and_choices == [{"role": "user", "content": "sub-task"}]
    assert back[2].trajectories[0].reward == -1.0
    # And it can be published again (the wire checks pass on what was read back).
    event = back[0].to_event(project="p", model="m")
    assert event.trajectories[0].messages[2].tool_calls[0].function.name == "lookup"


@needs_pyarrow
def test_parquet_reads_with_pandas(tmp_path):
    pd = pytest.importorskip("pandas")
    path = write_trajectory_groups_parquet(sample_groups(), tmp_path / "t.parquet")
    frame = pd.read_parquet(path)
    assert len(frame) == 4
    assert frame["reward"].mean() == pytest.approx((0.75 + 0.0 - 1.0) / 3)  # the empty group is NaN
    assert json.loads(frame.loc[0, "metadata"])["scenario"] == "ñandú-1"
    assert frame.loc[0, "messages"][1]["content"] == "What is a ñandú? 🐦"
    assert frame["metadata"].isna().tolist() == [False, True, True, True]


@needs_pyarrow
def test_parquet_of_no_groups_and_replacing_a_file(tmp_path):
    path = write_trajectory_groups_parquet([], tmp_path / "deep" / "er" / "0000.parquet")
    assert pq.read_table(path).num_rows == 0 and read_trajectory_groups_parquet(path) == []
    write_trajectory_groups_parquet(sample_groups(), path)
    assert pq.read_table(path).num_rows == 4
    assert sorted(p.name for p in path.parent.iterdir()) == ["0000.parquet"]  # no partial file left


@needs_pyarrow
def test_parquet_keeps_content_parts_as_json_text(tmp_path):
    parts = [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "data:,x"}}]
    group = art.TrajectoryGroup([art.Trajectory(messages_and_choices=[{"role": "user", "content": parts}])])
    path = write_trajectory_groups_parquet([group], tmp_path / "p.parquet")
    content = pq.read_table(path).to_pylist()[0]["messages"][0]["content"]
    assert json.loads(content) == parts


# --- model.log ------------------------------------------------------------------------------


class StubBackend:
    """What Model.register/publish/get_step use of a backend; no server."""

    def __init__(self, step: int = 5):
        self.published: list[tuple[int, str]] = []
        self.step = step
        self.inference_api_key = None

    async def register(self, model):
        pass

    async def _inference_url(self, model):
        return "http://127.0.0.1:1/v1"

    async def publish(self, model, groups, *, split):
        groups = list(groups)
        self.published.append((len(groups), split))
        return [f"id{i}" for i in range(len(groups))]

    async def _get_step(self, model):
        return self.step


@needs_pyarrow
async def test_model_log_writes_history_and_arts_parquet(tmp_path):
    backend = StubBackend(step=5)
    model = art.TrainableModel(name="m", project="p", base_model="b", base_path=str(tmp_path))
    await model.register(backend)
    row = await model.log(sample_groups(), split="val")
    assert backend.published == [(2, "val")]  # the empty group is not published
    history = [json.loads(line) for line in (model.directory / "history.jsonl").read_text().splitlines()]
    assert history[0]["step"] == 5 and history[0]["val/reward"] == pytest.approx(row["val/reward"])
    path = model.directory / "trajectories" / "val" / "0005.parquet"
    assert [len(g) for g in read_trajectory_groups_parquet(path)] == [2, 0, 1]

    await model.log(
        [art.Trajectory(reward=1.0, messages_and_choices=[{"role": "user", "content": "q"}])],
        "train",
        step=12,
    )
    assert pq.read_table(model.directory / "trajectories" / "train" / "0012.parquet").column(
        "reward"
    ).to_pylist() == [1.0]
    await model.log(metrics={"loss/x": 1.0}, step=13)  # metrics only: no trajectory file
    assert not (model.directory / "trajectories" / "val" / "0013.parquet").exists()
    assert len((model.directory / "history.jsonl").read_text().splitlines()) == 3


async def test_model_log_without_pyarrow_keeps_the_history_and_says_what_to_install(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_pyarrow(name, *args, **kwargs):
        if name == "pyarrow" or name.startswith("pyarrow."):
            raise ImportError("No module named 'pyarrow'")
        return real_import(name, *args, **kwargs)

    model = art.Model(name="m", project="p", base_path=str(tmp_path))
    await model.register(StubBackend())
    monkeypatch.setattr(builtins, "__import__", no_pyarrow)
    with pytest.raises(ImportError, match=r"artery\[log\]"):
        await model.log([art.Trajectory(reward=1.0, messages_and_choices=[{"role": "user", "content": "q"}])])
    monkeypatch.undo()
    assert json.loads((model.directory / "history.jsonl").read_text())["val/reward"] == 1.0


async def test_rollouts_of_skipped_groups_are_closed_not_left_never_awaited():
    """``TrajectoryGroup(rollout() for ...)`` creates its rollouts at once. A group that never
    runs (its batch skipped) closes them (``artery.unstarted``) rather than leaving the garbage
    collector to warn that each was never awaited; the groups that run are left alone."""
    created: list[Any] = []

    async def rollout(i: int) -> art.Trajectory:
        return art.Trajectory(reward=float(i))

    def group(g: int) -> Any:
        rollouts = [rollout(10 * g + j) for j in range(2)]
        created.extend(rollouts)
        return art.TrajectoryGroup(iter(rollouts))

    batches = [
        b async for b in trajectory_group_batches((group(g) for g in range(4)), batch_size=2, skip_batches=1)
    ]
    assert [sorted(t.reward for grp in b for t in grp.trajectories) for b in batches] == [[20, 21, 30, 31]]
    states = [inspect.getcoroutinestate(c) for c in created]
    # the skipped four closed (not CORO_CREATED, which would warn when collected), the rest run
    assert states == [inspect.CORO_CLOSED] * 8
