"""Which checkpoints to delete (pure: no NATS, no database).

The rule is ART's ``delete_checkpoints``: keep the latest step, plus the step with the best
value of a chosen metric, and delete the rest; here ``keep_latest`` may keep more than one of the
newest steps. Only live checkpoints count: one already deleted is neither kept nor deleted again.
A step that did not report the metric (or reported a NaN or an infinity) is never the best; when
two steps tie, the later one is the best (the more trained adapter).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

BestMode = Literal["max", "min"]


@dataclass(frozen=True, slots=True)
class Checkpoint:
    step: int
    metrics: Mapping[str, float]
    deleted: bool = False


@dataclass(frozen=True, slots=True)
class RetentionPolicy:
    #: How many of the newest steps are kept (at least 1: the latest is never deleted).
    keep_latest: int = 1
    #: The metric whose best step is also kept; None keeps only the newest steps.
    best_metric: str | None = "reward_mean"
    best_mode: BestMode = "max"
    #: Steps kept whatever their metrics (chosen by the caller).
    keep_steps: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.keep_latest < 1:
            raise ValueError(f"keep_latest must be at least 1, not {self.keep_latest}")
        if self.best_mode not in ("max", "min"):
            raise ValueError(f"best_mode must be 'max' or 'min', not {self.best_mode!r}")


@dataclass(frozen=True, slots=True)
class RetentionPlan:
    keep: tuple[int, ...]  # ascending
    delete: tuple[int, ...]  # ascending
    best: int | None = None


def best_step(checkpoints: Iterable[Checkpoint], metric: str, mode: BestMode = "max") -> int | None:
    """The step with the best finite value of ``metric``; the later step on a tie; None if none has it."""
    sign = 1.0 if mode == "max" else -1.0
    best: tuple[float, int] | None = None
    for c in checkpoints:
        value = c.metrics.get(metric)
        if value is None or isinstance(value, bool) or not math.isfinite(value):
            continue
        candidate = (sign * float(value), c.step)
        if best is None or candidate > best:
            best = candidate
    return None if best is None else best[1]


def plan_retention(checkpoints: Iterable[Checkpoint], policy: RetentionPolicy) -> RetentionPlan:
    """Split the live checkpoints into those to keep and those to delete."""
    live = sorted((c for c in checkpoints if not c.deleted), key=lambda c: c.step)
    steps = [c.step for c in live]
    if len(set(steps)) != len(steps):
        raise ValueError(f"a step appears twice: {steps}")
    keep = set(steps[-policy.keep_latest :]) | set(policy.keep_steps)
    best = best_step(live, policy.best_metric, policy.best_mode) if policy.best_metric else None
    if best is not None:
        keep.add(best)
    return RetentionPlan(
        keep=tuple(s for s in steps if s in keep),
        delete=tuple(s for s in steps if s not in keep),
        best=best,
    )
