"""SDK ↔ trainer: ask for a training step, hear how it went."""

from __future__ import annotations

import math
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
    #: ART 0.3's name for the KL penalty's coefficient (its ``TrainConfig(beta=...)``): given alone,
    #: it is ``kl_penalty_coef``, as ART itself renamed it (the penalty is ART's current one, applied
    #: through the advantage against the base model, not 0.3's loss term).
    beta: Annotated[float, msgspec.Meta(ge=0)] = 0.0

    def __post_init__(self) -> None:
        if self.beta and self.kl_penalty_coef and self.beta != self.kl_penalty_coef:
            raise ValueError(
                f"beta={self.beta} and kl_penalty_coef={self.kl_penalty_coef} name one coefficient: give one"
            )
        if self.beta:
            self.kl_penalty_coef = self.beta


#: The most groups one step may name: far above a GRPO step (tens to hundreds of groups), and
#: low enough that a runaway request cannot make the trainer load the whole table into memory.
MAX_GROUPS_PER_STEP = 10_000


class TrainRequested(Event, kw_only=True, tag="train.requested"):
    """One training step over the named groups (stored by the collector)."""

    group_ids: Annotated[list[EventId], msgspec.Meta(min_length=1, max_length=MAX_GROUPS_PER_STEP)]
    config: TrainConfig = msgspec.field(default_factory=TrainConfig)
    #: Asynchronous (off-policy) mode when set: inference is not paused while the step trains,
    #: trajectories sampled more than this many steps before the step's starting policy are
    #: dropped (and counted), and the rest are corrected by truncated importance sampling on their
    #: sampled logprobs (``config.truncated_importance_sampling``, default cap 2.0).
    max_steps_off_policy: Annotated[int, msgspec.Meta(ge=0, le=1000)] | None = None


#: The most batches (learning rates) one SFT request may name.
MAX_SFT_BATCHES = 100_000
#: What ``batch_size="auto"`` resolves to: ART's LocalBackend default (2 trajectories per batch).
SFT_AUTO_BATCH_SIZE = 2
LearningRate = Annotated[float, msgspec.Meta(gt=0)]


class TrainSFTConfig(Struct, kw_only=True):
    """ART's ``TrainSFTConfig``: supervised fine-tuning on the assistant turns of trajectories.

    The trajectories are trained in order, ``batch_size`` per optimizer step; ``learning_rate`` is
    one rate for every batch, or a list with one rate per batch (a schedule), in order.
    """

    learning_rate: (
        LearningRate | Annotated[list[LearningRate], msgspec.Meta(min_length=1, max_length=MAX_SFT_BATCHES)]
    ) = 5e-5
    #: Trajectories per optimizer step; ``"auto"`` is ``SFT_AUTO_BATCH_SIZE``.
    batch_size: Annotated[int, msgspec.Meta(ge=1)] | Literal["auto"] = "auto"

    def resolved_batch_size(self) -> int:
        return SFT_AUTO_BATCH_SIZE if self.batch_size == "auto" else self.batch_size

    def learning_rates(self, num_trajectories: int) -> list[float]:
        """The learning rate of each batch, for ``num_trajectories`` trajectories in order.

        Raises ``ValueError`` when a list of rates does not have one per batch, or a rate is
        not a finite positive number (msgpack carries NaN and infinities)."""
        batches = math.ceil(num_trajectories / self.resolved_batch_size())
        if isinstance(self.learning_rate, list):
            rates = [float(r) for r in self.learning_rate]
            if len(rates) != batches:
                raise ValueError(
                    f"{len(rates)} learning rates for {batches} batches"
                    f" ({num_trajectories} trajectories, {self.resolved_batch_size()} per batch)"
                )
        else:
            rates = [float(self.learning_rate)] * batches
        if not all(math.isfinite(r) and r > 0 for r in rates):
            raise ValueError("learning rates must be finite and > 0")
        return rates


class TrainSFTRequested(Event, kw_only=True, tag="train.sft_requested"):
    """One supervised fine-tuning step over the named groups' trajectories (stored by the collector).

    Published on the same subject as ``train.requested`` and answered the same way
    (``train.completed`` or ``train.failed`` with its ``request_id``): the trajectories of the
    groups, in the order of ``group_ids``, are trained with cross-entropy on their assistant
    tokens, ``config.batch_size`` per optimizer step, and the step is published like a GRPO step.
    """

    group_ids: Annotated[list[EventId], msgspec.Meta(min_length=1, max_length=MAX_GROUPS_PER_STEP)]
    config: TrainSFTConfig = msgspec.field(default_factory=TrainSFTConfig)


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


#: What the trainer consumes on ``artery.train.requested.<project>.<model>``.
TrainRequest = TrainRequested | TrainSFTRequested
TrainingEvent = TrainRequested | TrainSFTRequested | TrainCompleted | TrainFailed
__all__ = [
    "LossFn",
    "Step",
    "TrainCompleted",
    "TrainConfig",
    "TrainFailed",
    "TrainRequest",
    "TrainRequested",
    "TrainSFTConfig",
    "TrainSFTRequested",
]
