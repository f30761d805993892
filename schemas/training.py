"""SDK ↔ trainer: ask for a training step, hear how it went."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from artery.schemas.base import Event, EventId, Step, Struct

LossFn = Literal["cispo", "grpo", "dr_grpo", "dapo", "ppo"]


class TrainConfig(Struct, kw_only=True):
    """Per-step knobs (ART's ``TrainConfig`` plus the ``backend.train`` keywords we honour)."""

    learning_rate: Annotated[float, msgspec.Meta(gt=0)] = 5e-6
    loss_fn: LossFn = "cispo"
    kl_penalty_coef: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    scale_rewards: bool = True
    epsilon: float | None = None
    epsilon_high: float | None = None
    truncated_importance_sampling: float | None = None
    grad_accumulation_sequences: Annotated[int, msgspec.Meta(ge=1)] | None = None
    max_grad_norm: float | None = None


#: The most groups one step may name: far above a GRPO step (tens to hundreds of groups), and
#: low enough that a runaway request cannot make the trainer load the whole table into memory.
MAX_GROUPS_PER_STEP = 10_000


class TrainRequested(Event, kw_only=True, tag="train.requested"):
    """One training step over the named groups (stored by the collector)."""

    group_ids: Annotated[list[EventId], msgspec.Meta(min_length=1, max_length=MAX_GROUPS_PER_STEP)]
    config: TrainConfig = msgspec.field(default_factory=TrainConfig)
    #: Off-policy mode: groups sampled more than this many steps ago are dropped.
    max_steps_off_policy: int | None = None


class TrainCompleted(Event, kw_only=True, tag="train.completed"):
    """``step`` (envelope) is the new policy version; the adapter is published as it."""

    request_id: EventId
    metrics: dict[str, float] = {}
    checkpoint: str | None = None


class TrainFailed(Event, kw_only=True, tag="train.failed"):
    """The step asked for by ``request_id`` did not happen, and why."""

    request_id: EventId
    error: str
    #: Whether asking again can succeed (a lost lease) or not (no trainable groups).
    retriable: bool = False


TrainingEvent = TrainRequested | TrainCompleted | TrainFailed
__all__ = ["LossFn", "Step", "TrainCompleted", "TrainConfig", "TrainFailed", "TrainRequested"]
