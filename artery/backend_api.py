"""What a model asks of its backend, and what a training step returns.

``artery.model`` depends on this protocol, not on ``artery.backend``: the backend knows the model
(it reads its name, project and base model), the model knows only these calls, so each file
depends one way. ``Backend`` and ``LocalBackend`` implement it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from artery.schemas import ReplicaInfo, RetentionApplied, TrainSFTConfig
    from artery.trajectories import Trajectory, TrajectoryGroup


@dataclass
class TrainResult:
    """What one training step returned: the new step (policy version) and its metrics.

    A step that trained nothing still advances the step (see ``artery.backend``); ``trained`` is
    then False and ``skip_reason`` says why, with the counts, as the warning ``train()`` logs."""

    step: int
    metrics: dict[str, float]
    #: The trace of this step (``train()`` through trainer, publisher and adapter load).
    trace_id: str | None = None
    #: Whether the step changed the adapter (at least one token trained, a finite gradient).
    trained: bool = True
    #: Why nothing was trained, for people; None when ``trained``.
    skip_reason: str | None = None

    @classmethod
    def of(cls, step: int, metrics: dict[str, float], trace_id: str | None = None) -> TrainResult:
        trained = metrics.get("trained", 1.0) != 0.0
        return cls(
            step=step,
            metrics=metrics,
            trace_id=trace_id,
            trained=trained,
            skip_reason=None if trained else untrained_reason(metrics),
        )


#: What each of the trainer's ``dropped/<reason>`` counters means, and what to do about it.
DROP_REASONS = {
    "template": (
        "the chat template could not render these turns for training (SmolLM2's and many others "
        "have no {% generation %} markers) and they carried no sampled tokens: append the Choice "
        "objects Artery's inference returned, not text copies of them"
    ),
    "no_trainable_message": (
        "no assistant turn to train on: append the Choice objects the inference returned to "
        "messages_and_choices (assistant dicts are context only)"
    ),
    "no_trained_tokens": "the trained turns hold no token",
    "too_long": "longer than the trainer's max sequence length, with no trained token within it",
    "unsupported_content": "only text is trained on (image parts)",
    "bad_sample": "a sample's logprobs do not match its token ids, or its ids are outside the vocabulary",
}


def dropped_sequences(metrics: dict[str, float]) -> dict[str, int]:
    """The trainer's ``dropped/<reason>`` counts, less ``zero_advantage`` (the trajectories whose
    group gave them nothing to learn: skipped by design, not lost)."""
    return {
        key.removeprefix("dropped/"): int(value)
        for key, value in sorted(metrics.items())
        if key.startswith("dropped/") and key != "dropped/zero_advantage" and value
    }


def describe_drops(dropped: dict[str, int]) -> str:
    return "; ".join(
        f"{reason}: {n} ({DROP_REASONS.get(reason, 'see the trainer log')})" for reason, n in dropped.items()
    )


def untrained_reason(metrics: dict[str, float]) -> str:
    """Why a step trained nothing, read from the counters the trainer sends with ``train.completed``
    (the same decision the trainer made: every group skipped, every sequence dropped, or a gradient
    that was not finite)."""
    groups = int(metrics.get("groups", 0))
    equal = int(metrics.get("groups_skipped_equal_rewards", 0))
    small = int(metrics.get("groups_skipped_too_small", 0))
    stale = int(metrics.get("offpolicy/trajectories_dropped", 0))
    off_policy = f"{stale} trajectories dropped as too far off-policy (max_steps_off_policy)" if stale else ""
    dropped = dropped_sequences(metrics)
    if groups and equal + small >= groups:
        parts = []
        if equal:
            parts.append(
                f"{equal} with equal rewards (GRPO learns only from reward differences within a group)"
            )
        if small:
            parts.append(f"{small} with fewer than two trajectories (nothing to compare)")
        reason = f"every group was skipped: of {groups}, " + ", ".join(parts)
    elif dropped:
        total = sum(dropped.values())
        reason = f"every sequence was dropped ({total}): {describe_drops(dropped)}"
    elif off_policy:
        return f"no trajectory was left: {off_policy}"
    elif metrics.get("tokens_trained", 0.0) > 0:
        reason = "the gradient was not finite, so the optimizer step was not applied"
    else:
        reason = "no trajectory gave a token to train on"
    return f"{reason}; {off_policy}" if off_policy else reason


class TrainingFailed(RuntimeError):
    """The trainer answered ``train.failed``; ``retriable`` says whether asking again can help."""

    def __init__(self, message: str, *, retriable: bool):
        super().__init__(message)
        self.retriable = retriable


class ModelBackend(Protocol):
    """The calls ``Model`` and ``TrainableModel`` make on the backend they are registered with
    (``model`` is the caller itself: typed ``Any`` here, so that this module never imports it)."""

    inference_api_key: str | None

    async def register(self, model: Any) -> None: ...

    async def _inference_url(self, model: Any, timeout_s: float = ...) -> str | None: ...

    async def replicas(self, model: Any) -> list[ReplicaInfo]: ...

    async def _get_step(self, model: Any) -> int: ...

    async def publish(
        self, model: Any, groups: Iterable[TrajectoryGroup], *, split: str = "train"
    ) -> list[str]: ...

    async def train(self, model: Any, groups: Iterable[TrajectoryGroup], **kwargs: Any) -> TrainResult: ...

    async def train_sft(
        self,
        model: Any,
        trajectories: Iterable[Trajectory],
        config: TrainSFTConfig | None = None,
    ) -> TrainResult: ...

    async def delete_checkpoints(
        self,
        model: Any,
        *,
        best_checkpoint_metric: str | None = ...,
        keep_latest: int = ...,
        keep_steps: Iterable[int] = ...,
    ) -> RetentionApplied: ...
