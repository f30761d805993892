"""The model registry entry: the value under ``<project>.<model>`` in the models KV bucket."""

from __future__ import annotations

from typing import Any

from artery.schemas.base import Name, Step, Struct, Timestamp


class ModelRecord(Struct, kw_only=True):
    """Written by ``model.register()``; ``step`` is advanced by the trainer after each step."""

    project: Name
    name: Name
    base_model: str | None = None
    trainable: bool = False
    config: dict[str, Any] = {}
    step: Step = 0
    registered_at: Timestamp | None = None
