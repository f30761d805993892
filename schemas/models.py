"""The model registry entry: the value under ``<project>.<model>`` in the models KV bucket."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from artery.schemas.base import Event, Name, Step, Struct, Timestamp
from artery.schemas.control import ReplicaInfo

ModuleName = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]


class LoraSpec(Struct, kw_only=True):
    """The adapter's shape asked for at registration (``art.LoRAConfig``); unset: the trainer's
    defaults (``ARTERY_TRAINER_LORA_*``). Fixed once a model has trained: a step's optimizer state
    only fits the adapter it was made for."""

    rank: Annotated[int, msgspec.Meta(ge=1, le=4096)] | None = None
    alpha: Annotated[float, msgspec.Meta(gt=0, le=1e6)] | None = None
    dropout: Annotated[float, msgspec.Meta(ge=0, lt=1)] | None = None
    target_modules: Annotated[list[ModuleName], msgspec.Meta(min_length=1)] | None = None


class ModelRecord(Struct, kw_only=True):
    """Written by ``model.register()``; ``step`` is advanced by the trainer after each step."""

    project: Name
    name: Name
    base_model: str | None = None
    trainable: bool = False
    config: dict[str, Any] = {}
    step: Step = 0
    registered_at: Timestamp | None = None
    lora: LoraSpec | None = None
    #: Extra chat-template variables the SDK's client sends with every request (ART's
    #: ``InternalModelConfig.chat_template_kwargs``).
    chat_template_kwargs: dict[str, Any] = {}


class ModelRegistrationRequested(Event, kw_only=True, tag="model.register"):
    """``register()``: the record an agent asks for, sent to the publisher (request/reply), which
    checks it (the subject's model, an allowed base model, the LoRA shape once trained) and writes
    the models bucket itself. Agents never write that bucket; ``step`` is kept as it is."""

    record: ModelRecord


class ModelRegistered(Event, kw_only=True, tag="model.registered"):
    """The publisher's answer to ``ModelRegistrationRequested``: the record as stored, or why
    nothing was stored (``error``, ``<kind>: <reason>``)."""

    record: ModelRecord | None = None
    error: str | None = None


class ReplicasRequested(Event, kw_only=True, tag="replicas.list"):
    """The live inference replicas of a model, asked of the publisher (request/reply): agents
    create no consumers, so the replicas bucket is read on their behalf."""


class ReplicasListed(Event, kw_only=True, tag="replicas.listed"):
    """The publisher's answer to ``ReplicasRequested``."""

    replicas: list[ReplicaInfo] = []
    error: str | None = None
