"""Experiment tracking and observability integrations, each behind an optional extra.

- ``artery.integrations.wandb``: ``Model(report_metrics=["wandb"])`` (or ``WANDB_API_KEY`` set)
  sends what ``model.log`` and ``model.train`` write to ``history.jsonl`` to Weights & Biases
  (the ``wandb`` extra).
- Langfuse lives in ``artery.shared.langfuse`` (every service's tracing set-up uses it too):
  ``LANGFUSE_HOST`` / ``LANGFUSE_PUBLIC_KEY`` / ``LANGFUSE_SECRET_KEY`` add Langfuse's
  OpenTelemetry endpoint to the process's span exporters (no extra: OTLP is in the core install).

Nothing here is imported until a model or the tracing set-up asks for it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from artery.trajectories import TrajectoryGroup


class TrackedModel(Protocol):
    """What a tracker reads of ``artery.model.Model`` and keeps on it (this package does not
    import the model: the model imports it)."""

    name: str
    project: str
    entity: str | None
    config: Any
    report_metrics: list[str] | None
    _wandb_run: Any
    _wandb_failed: bool

    @property
    def directory(self) -> Path: ...


async def report(
    model: TrackedModel,
    row: dict[str, Any],
    groups: list[TrajectoryGroup] | None = None,
    split: str | None = None,
) -> None:
    """Send one ``history.jsonl`` row (and the groups it summarises) to the model's trackers."""
    from artery.integrations import wandb as wandb_integration

    if wandb_integration.wanted(model):
        await wandb_integration.log(model, row, groups, split)
