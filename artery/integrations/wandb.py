"""Weights & Biases: what ``model.log`` and ``model.train`` write to ``history.jsonl``, also to W&B.

As in ART, a model reports to W&B when ``"wandb"`` is in its ``report_metrics``, or when
``report_metrics`` is left unset and ``WANDB_API_KEY`` is set. The run is the model's:
project ``model.project``, name and id ``model.name`` (resumed if it exists), entity
``model.entity``; its files go under ``WANDB_DIR`` or else the model's directory (beside
``history.jsonl``). Each row becomes one ``run.log`` with every metric of the row (``val/reward``,
``train/loss``...), plotted against ``training_step`` (the model's step), and the trajectories of
the row's groups as a table ``{split}/trajectories`` (step, group, reward, messages, metrics,
metadata). ``WANDB_MODE=offline`` keeps the run on disk (``wandb sync`` uploads it later).

Needs the ``wandb`` extra: ``pip install 'artery[wandb]'``. W&B failing to start (no credentials,
no network) is logged once and the model goes on without it: training never stops for a chart.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    from artery.integrations import TrackedModel as Model
    from artery.trajectories import TrajectoryGroup

__all__ = ["STEP_METRIC", "finish", "log", "run_of", "wanted"]

log_ = logging.getLogger(__name__)

#: The x axis of every chart: the model's training step (ART's name).
STEP_METRIC = "training_step"
#: Columns of the ``{split}/trajectories`` table.
TABLE_COLUMNS = ["step", "split", "group", "trajectory", "reward", "messages", "metrics", "metadata"]
_lock = threading.Lock()


def wanted(model: Model) -> bool:
    """Whether ``model`` reports to W&B (ART's rule)."""
    if getattr(model, "_wandb_failed", False):
        return False
    metrics = model.report_metrics
    if metrics is None:
        return bool(os.environ.get("WANDB_API_KEY"))
    return "wandb" in metrics


def _import_wandb(model: Model):
    try:
        import wandb
    except ImportError as exc:
        if model.report_metrics is None:  # only WANDB_API_KEY set: no W&B without the extra
            model._wandb_failed = True
            return None
        raise ImportError(
            "report_metrics=['wandb'] needs the 'wandb' extra: pip install 'artery[wandb]'"
        ) from exc
    return wandb


def run_of(model: Model) -> Any:
    """The model's W&B run, started (or resumed) on first use; ``None`` when W&B is off."""
    with _lock:
        run = getattr(model, "_wandb_run", None)
        if run is not None and not _finished(run):
            return run
        wandb = _import_wandb(model)
        if wandb is None:
            return None
        config: dict[str, Any] = {}
        base_model = getattr(model, "base_model", None)  # a TrainableModel's
        if base_model:
            config["base_model"] = base_model
        if model.config:
            config["config"] = model.config
        directory = None
        if not os.environ.get("WANDB_DIR"):
            directory = str(model.directory)
            os.makedirs(directory, exist_ok=True)
        arguments = {
            "project": model.project,
            "entity": model.entity,
            "name": model.name,
            "id": model.name,
            "resume": "allow",
            "config": config,
            "dir": directory,
            "settings": wandb.Settings(console="off"),
        }
        try:
            try:  # one run per model, several models in a process (W&B >= 0.19.10)
                run = wandb.init(**arguments, reinit="create_new")
            except ValueError:  # an older W&B: one run at a time
                run = wandb.init(**arguments, reinit=True)
        except Exception as exc:
            model._wandb_failed = True
            log_.warning("W&B run for %r not started, logging to history.jsonl only: %s", model, exc)
            return None
        run.define_metric(STEP_METRIC)
        run.define_metric("*", step_metric=STEP_METRIC)
        model._wandb_run = run
        return run


def _finished(run: Any) -> bool:
    return bool(getattr(run, "_is_finished", False))


async def log(
    model: Model,
    row: dict[str, Any],
    groups: list[TrajectoryGroup] | None = None,
    split: str | None = None,
) -> None:
    """One ``history.jsonl`` row (``step`` and its metrics) and its groups' trajectories."""
    run = await asyncio.to_thread(run_of, model)
    if run is None:
        return
    step = int(row.get("step") or 0)
    data: dict[str, Any] = {
        k: v for k, v in row.items() if k not in ("step", "recorded_at") and isinstance(v, int | float)
    }
    data[STEP_METRIC] = step
    if groups and split:
        data[f"{split}/trajectories"] = _table(model, groups, split, step)
    await asyncio.to_thread(run.log, data)


def _table(model: Model, groups: list[TrajectoryGroup], split: str, step: int) -> Any:
    import wandb

    rows = []
    for g, group in enumerate(groups):
        for t, trajectory in enumerate(group):
            rows.append(
                [
                    step,
                    split,
                    g,
                    t,
                    float(trajectory.reward),
                    _messages_text(trajectory),
                    json.dumps(trajectory.metrics, default=str),
                    json.dumps(trajectory.metadata, default=str),
                ]
            )
    # A list of its own: wandb types the columns as list[str | int], which a list[str] is not.
    return wandb.Table(columns=list(TABLE_COLUMNS), data=rows)


def _messages_text(trajectory: Any) -> str:
    """The conversation as JSON, without the token ids and logprobs (they are training data)."""
    try:
        messages = msgspec.to_builtins(trajectory.to_wire().messages)
    except (ValueError, msgspec.ValidationError):
        return ""
    for message in messages:
        message.pop("sample", None)
        message.pop("trainable", None)
    return json.dumps(messages, ensure_ascii=False)


def finish(model: Model) -> None:
    """Finish the model's run (W&B also finishes it when the process exits)."""
    with _lock:
        run = getattr(model, "_wandb_run", None)
        model._wandb_run = None
    if run is not None and not _finished(run):
        run.finish()
