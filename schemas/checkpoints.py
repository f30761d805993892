"""Trainer → publisher → inference: adapters saved, published, retired; and retention on demand."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from artery.schemas.base import Event

Sha256 = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{64}$")]


class CheckpointSaved(Event, kw_only=True, tag="checkpoint.saved"):
    """The trainer wrote a LoRA adapter for ``step``; the publisher takes it from here."""

    #: Where the trainer put it: ``nats-object://artery_trainer_state/<project>.<model>/<step:06d>/adapter.tar``
    #: (the trainer-state store; only the event's own model and step are read), or, from older
    #: trainers, ``file://`` on a volume shared with the publisher.
    uri: str
    sha256: Sha256
    size_bytes: Annotated[int, msgspec.Meta(ge=0)]
    base_model: str
    metrics: dict[str, float] = {}


class CheckpointStaged(Event, kw_only=True, tag="checkpoint.staged"):
    """The trainer stored the adapter for ``step`` and is storing the step's optimizer state; its
    ``checkpoint.saved`` follows once both are stored.

    A hint, on core NATS (no stream): a replica may fetch and unpack the adapter while the state
    is stored, and serves it only when ``checkpoint.saved`` names the same sha256. A hint lost, or
    a step that is never saved, costs that replica the prefetch and nothing else."""

    #: As in ``checkpoint.saved``: the adapter in the trainer-state store.
    uri: str
    sha256: Sha256
    size_bytes: Annotated[int, msgspec.Meta(ge=0)]
    base_model: str


class CheckpointPublished(Event, kw_only=True, tag="checkpoint.published"):
    """The adapter for ``step`` is in the Object Store; replicas load and serve it."""

    object_name: str
    sha256: Sha256
    size_bytes: Annotated[int, msgspec.Meta(ge=0)]
    base_model: str
    #: The name it is served under: ``<model>@<step>``.
    served_name: str


class CheckpointDeleted(Event, kw_only=True, tag="checkpoint.deleted"):
    """Retention removed the adapter for ``step``; replicas unload it."""

    object_name: str
    reason: str = "retention"


class RetentionRequested(Event, kw_only=True, tag="checkpoint.retain"):
    """Apply retention to a model's checkpoints now: what ``model.delete_checkpoints()`` sends.

    Sent as a NATS request (no stream) to ``artery.control.publisher.<project>.<model>.retain``;
    the publisher answers with ``RetentionApplied``. It keeps the ``keep_latest`` newest steps
    and the step with the best value of ``best_metric`` (as the trainer reported it in
    ``checkpoint.saved``), and deletes every other adapter, publishing ``checkpoint.deleted``
    for each. ``best_metric: null`` keeps only the newest steps. The latest step is never deleted.
    """

    keep_latest: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] = 1
    #: The metric whose best step is kept (ART's ``best_checkpoint_metric``); null: none.
    best_metric: Annotated[str, msgspec.Meta(min_length=1, max_length=256)] | None
    #: Whether the best value of ``best_metric`` is the highest or the lowest.
    best_mode: Literal["max", "min"] = "max"
    #: Steps kept besides those (the SDK's best step by a metric of ``history.jsonl``).
    keep_steps: Annotated[list[Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(max_length=10_000)] = []


class RetentionApplied(Event, kw_only=True, tag="checkpoint.retained"):
    """The publisher's answer to ``RetentionRequested``: which steps are kept and which it deleted."""

    #: Steps whose adapters remain, ascending.
    kept: list[int] = []
    #: Steps deleted by this request, ascending (already deleted ones are not repeated).
    deleted: list[int] = []
    #: The step kept as the best by ``best_metric``, if any step reported it.
    best_step: int | None = None
    #: Set when the request could not be applied (invalid, or PostgreSQL unavailable).
    error: str | None = None


CheckpointEvent = CheckpointSaved | CheckpointPublished | CheckpointDeleted
