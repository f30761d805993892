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
    """What one training step returned: the new step (policy version) and its metrics."""

    step: int
    metrics: dict[str, float]
    #: The trace of this step (``train()`` through trainer, publisher and adapter load).
    trace_id: str | None = None


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
        **kwargs: Any,
    ) -> TrainResult: ...

    async def delete_checkpoints(
        self, model: Any, *, best_checkpoint_metric: str | None = ..., keep_latest: int = ...
    ) -> RetentionApplied: ...
