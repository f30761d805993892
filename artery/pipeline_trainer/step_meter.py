"""What a ``PipelineTrainer`` measures of itself each step, in ART's metric taxonomy
(``artery.metrics`` defines every key), and the window its autotune decides on."""

from __future__ import annotations

import math
import time

from artery.pipeline_config import AutotuneWindow

#: ART's freshness discount: a token sampled ``a`` steps ago is worth ``exp(-a / 8)`` of a fresh one.
FRESHNESS_SCALE_STEPS = 8.0


def freshness_discount(ages: list[tuple[int, int]]) -> float:
    """``1 / mean(exp(age / 8))`` over ``(age in steps, rollouts)`` pairs, weighted by rollouts."""
    total = sum(n for _, n in ages)
    if not total:
        return 1.0
    return total / sum(n * math.exp(age / FRESHNESS_SCALE_STEPS) for age, n in ages)


class StepMeter:
    """Counts between two steps (and over an autotune window); ``step_metrics`` reads and resets."""

    def __init__(self, gpu_cost_per_hour_usd: float | None = None) -> None:
        self.gpu_cost_per_hour_usd = gpu_cost_per_hour_usd
        self._step_started = self._window_started = time.monotonic()
        self._blocked_s = 0.0  # summed over workers since the last step
        self._window = {"wait_s": 0.0, "taken": 0, "stale": 0, "blocked_s": 0.0, "worker_s": 0.0}
        self._batch: dict[str, float] = {}
        self._ages: list[tuple[int, int]] = []

    def worker_blocked(self, seconds: float) -> None:
        """A rollout worker waited ``seconds`` for room in the queue or a fresh enough policy."""
        self._blocked_s += seconds

    def batch_collected(
        self, *, wait_s: float, taken: int, stale: int, ages: list[tuple[int, int]], queue_depth: int
    ) -> None:
        self._batch = {
            "wait_s": wait_s,
            "taken": float(taken),
            "stale": float(stale),
            "depth": float(queue_depth),
        }
        self._ages = ages

    def step_metrics(self, trainer_metrics: dict[str, float], workers: int) -> dict[str, float]:
        now = time.monotonic()
        wall_s = max(now - self._step_started, 1e-9)
        tokens = float(trainer_metrics.get("tokens_trained", 0.0))
        rollouts = sum(n for _, n in self._ages)
        tok_per_s = tokens / wall_s
        discount = freshness_discount(self._ages)
        taken, stale = self._batch.get("taken", 0.0), self._batch.get("stale", 0.0)
        worker_s = workers * wall_s
        metrics = {
            "objective/score": tok_per_s * discount,
            "sample_efficiency/freshness_discount": discount,
            "throughput/accepted_train_tok_per_s": tok_per_s,
            "offpolicy/rollout_weighted_policy_age_steps": (
                sum(age * n for age, n in self._ages) / rollouts if rollouts else 0.0
            ),
            "pipeline_trainer/step_collect_batch_s": self._batch.get("wait_s", 0.0),
            "pipeline_trainer/step_wall_s": wall_s,
            "pipeline_trainer/num_rollout_workers": float(workers),
            "queue/depth": self._batch.get("depth", 0.0),
            "queue/actual_stale_fraction": stale / taken if taken else 0.0,
            "queue/put_wait_frac": min(1.0, self._blocked_s / worker_s),
        }
        if self.gpu_cost_per_hour_usd is not None:
            metrics["costs/gpu"] = wall_s * self.gpu_cost_per_hour_usd / 3600.0
        window = self._window
        window["wait_s"] += self._batch.get("wait_s", 0.0)
        window["taken"] += int(taken)
        window["stale"] += int(stale)
        window["blocked_s"] += self._blocked_s
        window["worker_s"] += worker_s
        self._step_started, self._blocked_s, self._batch, self._ages = now, 0.0, {}, []
        return metrics

    def take_window(self) -> AutotuneWindow:
        """The window since the last call, for ``next_rollout_workers``; a new one starts."""
        now, window = time.monotonic(), self._window
        taken = AutotuneWindow(
            wall_s=now - self._window_started,
            trainer_wait_s=window["wait_s"],
            groups_taken=int(window["taken"]),
            groups_stale=int(window["stale"]),
            put_wait_frac=min(1.0, window["blocked_s"] / window["worker_s"]) if window["worker_s"] else 0.0,
        )
        self._window_started = now
        self._window = {"wait_s": 0.0, "taken": 0, "stale": 0, "blocked_s": 0.0, "worker_s": 0.0}
        return taken
