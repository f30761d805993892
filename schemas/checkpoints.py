"""Trainer → publisher → inference: adapters saved, published, retired."""

from __future__ import annotations

from typing import Annotated

import msgspec

from artery.schemas.base import Event

Sha256 = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{64}$")]


class CheckpointSaved(Event, kw_only=True, tag="checkpoint.saved"):
    """The trainer wrote a LoRA adapter for ``step``; the publisher takes it from here."""

    #: Where the trainer wrote it (``file://`` on a shared volume, or an object name).
    uri: str
    sha256: Sha256
    size_bytes: Annotated[int, msgspec.Meta(ge=0)]
    base_model: str
    metrics: dict[str, float] = {}


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


CheckpointEvent = CheckpointSaved | CheckpointPublished | CheckpointDeleted
