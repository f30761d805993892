"""The context a gather sets for the rollouts inside it: how many trajectories to expect, which
finished, which raised. It owns the progress bar and enforces ``max_exceptions``.

Its own module so that both sides depend one way: ``TrajectoryGroup`` (trajectories.py) reports
to the current context, and the gathers (gather.py, batches.py) set it; neither imports the other.
"""

from __future__ import annotations

import contextvars
import math
from typing import Any, Protocol

from tqdm.auto import tqdm

from artery.utils.reward_given import reward_given


class Scored(Protocol):
    """What the progress bar reads of a finished trajectory (``artery.trajectories.Trajectory``,
    which this module does not import: trajectories imports it)."""

    reward: float
    metrics: dict[str, Any]


_current: contextvars.ContextVar[GatherContext | None] = contextvars.ContextVar("artery_gather", default=None)


def current_gather() -> GatherContext | None:
    return _current.get()


class TooManyExceptions(RuntimeError):
    """More rollouts raised than ``max_exceptions`` allows; the last one is the cause."""


class GatherContext:
    def __init__(
        self,
        desc: str | None,
        max_exceptions: int | float,
        max_metrics: int | None = None,
        *,
        window_groups: int | None = None,
    ):
        if max_exceptions < 0:
            raise ValueError("max_exceptions must be >= 0")
        self.max_exceptions = max_exceptions
        self.max_metrics = max_metrics
        #: Set by ``trajectory_group_batches``: counts start again at each ``reset`` (each batch),
        #: and a fractional ``max_exceptions`` is a fraction of one window's rollouts, that is
        #: ``window_groups`` groups of the average size announced so far (as ART's batches).
        self.window_groups = window_groups
        self.total = 0
        self.done = 0
        self.exceptions = 0
        #: Every rollout and every ``add_total`` call (one per group) so far; never reset.
        self.started = 0
        self.started_calls = 0
        self.sums: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.desc = desc
        self.pbar = tqdm(total=0, desc=desc, unit="rollout", dynamic_ncols=True)

    def add_total(self, n: int) -> None:
        self.total += n
        self.started += n
        self.started_calls += 1
        self.pbar.total = self._expected()
        self.pbar.refresh()

    def _expected(self) -> int:
        """The rollouts a fraction of exceptions is measured against (and the bar's total)."""
        if self.window_groups is not None and self.started_calls:
            return round(self.window_groups * self.started / self.started_calls)
        return self.total

    def allowed_exceptions(self) -> float:
        """``0 < x < 1`` is a fraction of all rollouts (of one window's); anything else is a count."""
        if 0 < self.max_exceptions < 1:
            return math.floor(self.max_exceptions * max(self._expected(), 1))
        return self.max_exceptions

    def reset(self) -> None:
        """Start a new window (the next batch): exceptions, means and the bar from zero.

        Rollouts still running stay announced; they finish in the new window.
        """
        self.total -= self.done
        self.done = 0
        self.exceptions = 0
        self.sums = {}
        self.counts = {}
        self.pbar.close()
        self.pbar = tqdm(total=self._expected(), desc=self.desc, unit="rollout", dynamic_ncols=True)

    def record_exception(self, exc: BaseException) -> None:
        self.exceptions += 1
        self.done += 1
        self.pbar.update(1)
        self._postfix()
        if self.exceptions > self.allowed_exceptions():
            raise TooManyExceptions(
                f"{self.exceptions} rollouts raised; max_exceptions={self.max_exceptions}"
            ) from exc

    def record_trajectory(self, trajectory: Scored) -> None:
        self.done += 1
        if reward_given(trajectory.reward):  # none given yet: not averaged in as 0.0
            self._add("reward", trajectory.reward)
        for key, value in trajectory.metrics.items():
            if isinstance(value, int | float) and (
                self.max_metrics is None or len(self.sums) < self.max_metrics or key in self.sums
            ):
                self._add(key, float(value))
        self.pbar.update(1)
        self._postfix()

    def _add(self, key: str, value: float) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + value
        self.counts[key] = self.counts.get(key, 0) + 1

    def means(self) -> dict[str, float]:
        return {k: self.sums[k] / self.counts[k] for k in self.sums}

    def _postfix(self) -> None:
        postfix = {k: f"{v:.3g}" for k, v in self.means().items()}
        if self.exceptions:
            postfix["exceptions"] = str(self.exceptions)
        self.pbar.set_postfix(postfix, refresh=False)

    def close(self) -> None:
        self.pbar.close()
