"""``PipelineTrainer`` set up the way the demo and the loop benchmark run it: a step trains on
exactly ``groups`` groups while the next step's groups are sampled, one step off policy at most."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from typing import Any

from artery.pipeline_trainer.trainer import PipelineTrainer, RolloutFn


def one_step_ahead(
    model: Any,
    backend: Any,
    rollout_fn: RolloutFn,
    scenarios: AsyncIterator[Any] | Iterable[Any],
    *,
    groups: int,
    learning_rate: float,
    max_steps: int,
    **options: Any,
) -> PipelineTrainer:
    """Batches of exactly ``groups`` groups, ``2 * groups`` rollout workers (the next step's groups
    are sampled during this one), ``max_steps_off_policy=1``, a fresh start (``resume=False``);
    ``options`` are any other ``PipelineTrainer`` keywords."""
    return PipelineTrainer(
        model,
        backend,
        rollout_fn,
        scenarios,
        None,
        num_rollout_workers=2 * groups,
        min_batch_size=groups,
        max_batch_size=groups,
        max_steps_off_policy=1,
        learning_rate=learning_rate,
        max_steps=max_steps,
        resume=False,
        **options,
    )
