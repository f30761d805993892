"""``art.PipelineRuntimeConfig`` and ``art.PipelineAutotuneConfig``, and Artery's autotune rule.

``PipelineRuntimeConfig`` groups the ``PipelineTrainer``'s pipeline sizes (workers, batch bounds,
queue), as ART's does. ``PipelineAutotuneConfig(mode="online")`` lets the trainer change the
number of rollout workers while it runs. Artery's rule is simpler than ART's (which also tunes
batch sizes from vLLM's load and sequence packing): every ``window_steps`` steps it looks at how
long the trainer waited for groups and how many groups went stale, and moves the worker count
(:func:`next_rollout_workers`, a pure function).
"""

from __future__ import annotations

from typing import Literal

import msgspec

from artery.utils.art_settings import note_no_effect


class PipelineRuntimeConfig(msgspec.Struct, kw_only=True, frozen=True):
    """The pipeline's sizes; ``None`` takes the ``PipelineTrainer``'s default."""

    num_rollout_workers: int = 16
    min_batch_size: int = 4
    max_batch_size: int | None = None
    queue_maxsize: int | None = None
    #: ART's score references; Artery's ``objective/score`` has no batch factor, so unused.
    score_reference_groups_per_step: float | None = 8.0
    score_reference_rollouts_per_group: float | None = None

    def __post_init__(self) -> None:
        for name in ("num_rollout_workers", "min_batch_size", "max_batch_size", "queue_maxsize"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"PipelineRuntimeConfig.{name} must be >= 1, got {value}")
        if self.max_batch_size is not None and self.max_batch_size < self.min_batch_size:
            raise ValueError("max_batch_size must be >= min_batch_size")


class _ArtOnlyAutotuneSettings(msgspec.Struct, kw_only=True, frozen=True):
    """ART's autotune settings for what Artery's rule does not tune (batch sizes, sequence packing,
    vLLM load), with ART's defaults: accepted so ART programs run unchanged, and one that is set
    to another value is said, once, to change nothing."""

    profile: str | None = None
    output_name: str = "latest"
    target_spill_probability: float = 0.03
    initial_model_calls_per_inference_gpu: int = 8
    initial_min_groups_per_packed_sequence: int = 8
    initial_max_groups_per_packed_sequence: int = 8
    packing_trials: int = 48
    packing_reservoir_multiplier: int = 2
    packing_reservoir_min_groups: int = 32
    packing_history_steps: int = 64
    packing_spill_prior_alpha: float = 1.0
    packing_spill_prior_beta: float = 8.0
    packing_spill_confidence: float = 0.8
    queue_running_reserve_fraction: float = 0.75
    trainer_load_severe_under_score: float = 0.50
    trainer_load_over_score: float = 0.04
    vllm_pressure_over_ratio: float = 0.80
    vllm_pressure_under_ratio: float = 0.50
    unused_and_dummy_high_frac: float = 0.25
    trainer_min_batch_lower_score: float = 0.15
    trainer_min_batch_raise_score: float = 0.10
    min_batch_collect_improvement_ratio: float = 0.85
    min_batch_trial_windows: int = 2
    recommendation_min_windows: int = 5
    recommendation_consecutive_holds: int = 2
    freshness_min_batch_floor_fraction: float = 0.85
    target_group_change_windows: int = 1
    target_group_increase_fraction: float = 0.20
    target_group_max_increase: int = 64
    target_group_min_relative_change: float = 0.10
    target_group_immediate_decrease_fraction: float = 0.25
    vllm_metric_interval_s: float = 1.0
    vllm_metric_timeout_window_frac: float = 0.35


_ART_DEFAULTS = _ArtOnlyAutotuneSettings()


class PipelineAutotuneConfig(_ArtOnlyAutotuneSettings, kw_only=True, frozen=True):
    """When and how far the rollout worker count moves (ART's names and defaults)."""

    #: "off": fixed workers; "online": tuned while training. ART's "profile" (replaying a saved
    #: tuning) is refused: Artery keeps no tuning profiles.
    mode: Literal["off", "online", "profile"] = "off"
    #: Steps per decision, and the first steps ignored (start-up is slower than the run).
    window_steps: int = 4
    warmup_ignore_steps: int = 3
    #: A move is ``worker_move_fraction`` of the current count, at least ``worker_step``, at most
    #: ``max_worker_move``; the count stays within ``1..max_rollout_workers``.
    worker_step: int = 2
    worker_move_fraction: float = 0.10
    max_worker_move: int = 16
    max_rollout_workers: int = 1024
    #: The trainer is underfed when it waited for groups more than this share of the window.
    trainer_load_under_score: float = 0.08
    #: Too many stale groups above ``stale_high_frac``; more workers only below ``stale_clear_frac``.
    stale_high_frac: float = 0.20
    stale_clear_frac: float = 0.10
    #: Workers mostly blocked on a full queue: fewer would do.
    queue_put_severe_frac: float = 1.0 / 3.0

    def __post_init__(self) -> None:
        if self.mode == "profile":
            raise ValueError(
                "PipelineAutotuneConfig(mode='profile'): Artery keeps no tuning profiles; use"
                " mode='online' (tuned while training) or set PipelineRuntimeConfig yourself"
            )
        for name in ("window_steps", "worker_step", "max_rollout_workers", "max_worker_move"):
            if getattr(self, name) < 1:
                raise ValueError(f"PipelineAutotuneConfig.{name} must be >= 1")
        if self.warmup_ignore_steps < 0 or not 0.0 < self.worker_move_fraction <= 1.0:
            raise ValueError("warmup_ignore_steps must be >= 0 and worker_move_fraction in (0, 1]")
        if self.stale_clear_frac > self.stale_high_frac:
            raise ValueError("stale_clear_frac must be <= stale_high_frac")
        changed = [
            name
            for name in _ArtOnlyAutotuneSettings.__struct_fields__
            if getattr(self, name) != getattr(_ART_DEFAULTS, name)
        ]
        if changed:
            note_no_effect(
                f"PipelineAutotuneConfig({', '.join(changed)})",
                "Artery's autotune moves the rollout worker count only (trainer wait, staleness)",
            )


class AutotuneWindow(msgspec.Struct, kw_only=True, frozen=True):
    """What the pipeline measured over the last ``window_steps`` steps."""

    #: Wall time of the window, and how much of it the training stage waited for groups.
    wall_s: float
    trainer_wait_s: float
    #: Groups taken from the queue, and how many of them were too old to train on.
    groups_taken: int
    groups_stale: int
    #: Share of the workers' time spent blocked (a full queue, or a policy too far behind).
    put_wait_frac: float


class AutotuneDecision(msgspec.Struct, kw_only=True, frozen=True):
    workers: int
    action: Literal["hold", "increase", "decrease"]
    reason: str


def next_rollout_workers(
    current: int, window: AutotuneWindow, config: PipelineAutotuneConfig
) -> AutotuneDecision:
    """The worker count for the next window.

    Staleness comes first: groups that go stale were sampled too early, so too many workers are
    ahead of the trainer. Then a trainer that waits for groups is underfed: more workers, unless
    staleness is still above its clearing level or the workers are mostly blocked (then the
    staleness bound, not the worker count, holds the trainer back). Workers blocked most of the
    time are more than the trainer can take: fewer. Otherwise the count holds.
    """
    stale = window.groups_stale / window.groups_taken if window.groups_taken else 0.0
    underfed = window.trainer_wait_s / window.wall_s if window.wall_s > 0 else 0.0
    move = min(config.max_worker_move, max(config.worker_step, round(current * config.worker_move_fraction)))
    lowest, highest = 1, config.max_rollout_workers
    if stale > config.stale_high_frac and current > lowest:
        return AutotuneDecision(
            workers=max(lowest, current - move), action="decrease", reason=f"stale fraction {stale:.2f}"
        )
    blocked = window.put_wait_frac >= config.queue_put_severe_frac
    if (
        underfed > config.trainer_load_under_score
        and stale <= config.stale_clear_frac
        and not blocked
        and current < highest
    ):
        return AutotuneDecision(
            workers=min(highest, current + move), action="increase", reason=f"trainer waited {underfed:.0%}"
        )
    if blocked and current > lowest:
        return AutotuneDecision(
            workers=max(lowest, current - move),
            action="decrease",
            reason=f"workers blocked {window.put_wait_frac:.0%}",
        )
    return AutotuneDecision(workers=current, action="hold", reason="fed and fresh")
