"""``art.pipeline_trainer``: ART's asynchronous (off-policy) training loop on Artery's services."""

from artery.pipeline_trainer.trainer import (
    EvalFn,
    PipelineTrainer,
    PolicyCollapsed,
    RolloutFn,
    SingleRolloutFn,
    make_group_rollout_fn,
)

__all__ = [
    "EvalFn",
    "PipelineTrainer",
    "PolicyCollapsed",
    "RolloutFn",
    "SingleRolloutFn",
    "make_group_rollout_fn",
]
