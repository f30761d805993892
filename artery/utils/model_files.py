"""The files ART keeps in a model's directory (``<base>/<project>/models/<name>/``): the state
(``state.json``) and the metric history (``history.jsonl``) that ``delete_checkpoints`` reads."""

from __future__ import annotations

import copy
import json
import math
import os
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

from artery.trajectories import TrajectoryGroup

#: Attributes a model's copy shares with the original instead of copying (connections, caches).
_SHARED_STATE = frozenset({"_backend", "_openai_client"})


def jsonable(value: Any) -> Any:
    """``value`` with pydantic models (ART configs often are) turned into plain data."""
    if hasattr(value, "model_dump") and callable(value.model_dump):
        return value.model_dump(mode="json")
    return value


def read_json(path: Path) -> Any | None:
    """The JSON document at ``path``, or None when there is none."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


def write_json(path: Path, value: Any) -> None:
    """Write ``value`` as JSON, whole or not at all (a crash mid-write leaves the old file)."""
    text = json.dumps(jsonable(value))  # refused here, before the old file is touched
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def best_step_in_history(path: Path, metric: str) -> int | None:
    """The step whose mean ``metric`` in ``history.jsonl`` is highest (the later step on a tie),
    as ART's ``delete_checkpoints`` picks it; None when no row has a finite value of it."""
    values: dict[int, list[float]] = defaultdict(list)
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return None
    for line in lines:
        if not line.strip():
            continue
        row = json.loads(line)
        value, step = row.get(metric), row.get("step")
        if isinstance(value, bool) or not isinstance(value, int | float) or not isinstance(step, int):
            continue
        if math.isfinite(value):
            values[step].append(float(value))
    if not values:
        return None
    return max(values, key=lambda s: (sum(values[s]) / len(values[s]), s))


class ModelFiles:
    """``Model``'s state API (ART keeps it in ``state.json`` in the model's directory) and its
    pydantic ``model_copy``; the model class provides ``directory``."""

    #: The model's OpenAI client, made on first use (a copy makes its own).
    _openai_client: Any

    @property
    def directory(self) -> Path:
        raise NotImplementedError("the model class says where its directory is")

    def model_copy(self, *, update: dict[str, Any] | None = None, deep: bool = False):
        """A copy (``deep``: of the config and every field too); it shares the original's backend
        registration, as ART's copies do, and opens its own OpenAI client."""
        new = copy.copy(self)
        if deep:
            for key, value in vars(self).items():
                if key not in _SHARED_STATE:
                    setattr(new, key, copy.deepcopy(value))
        new._openai_client = None
        for key, value in (update or {}).items():
            setattr(new, key, value)
        return new

    def read_state(self) -> dict[str, Any] | None:
        """The model's saved state (``state.json`` in its directory, as ART), or None."""
        return read_json(self.directory / "state.json")

    def overwrite_state(self, state: dict[str, Any]) -> None:
        """Replace the model's saved state with ``state`` (JSON-serialisable)."""
        write_json(self.directory / "state.json", state)

    def merge_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """Update the saved state with ``state``'s keys; returns the state now saved."""
        merged = {**(self.read_state() or {}), **state}
        self.overwrite_state(merged)
        return merged


def append_history(path: Path, row: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def as_groups(items) -> list[TrajectoryGroup]:
    if items is None:
        return []
    items = list(items)
    if all(isinstance(i, TrajectoryGroup) for i in items):
        return items
    return [TrajectoryGroup([t]) for t in items]


def summarize(groups: list[TrajectoryGroup]) -> dict[str, float]:
    """ART's averages: reward, exception_rate, each metric, reward_std_dev (within-group)."""
    trajectories = [t for g in groups for t in g]
    exceptions = sum(len(g.exceptions) for g in groups)
    out: dict[str, float] = {}
    if trajectories:
        out["reward"] = statistics.fmean(t.reward for t in trajectories)
        keys = {k for t in trajectories for k in t.metrics}
        for key in sorted(keys):
            values = [float(t.metrics[key]) for t in trajectories if key in t.metrics]
            out[key] = statistics.fmean(values)
        stds = [statistics.pstdev([t.reward for t in g]) for g in groups if len(g) > 1]
        if stds:
            out["reward_std_dev"] = statistics.fmean(stds)
    total = len(trajectories) + exceptions
    out["exception_rate"] = exceptions / total if total else 0.0
    return out
