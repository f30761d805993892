"""The pydantic methods ART's examples call on trajectories (``model_dump``, ``model_copy``,
``for_logging``): ART's ``Trajectory`` and ``TrajectoryGroup`` are pydantic models, Artery's are
plain classes carrying the same fields."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import msgspec

from artery.utils.reward_given import reward_given


def dump_value(value: Any, mode: str = "python") -> Any:
    """``value`` as plain data: OpenAI objects through their own ``model_dump``, containers item by item."""
    if hasattr(value, "model_dump") and callable(value.model_dump):
        return value.model_dump(mode=mode)
    if isinstance(value, msgspec.Struct):
        return msgspec.to_builtins(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: dump_value(getattr(value, f.name), mode) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {k: dump_value(v, mode) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [dump_value(v, mode) for v in value]
    if not reward_given(value):
        return None
    return copy.deepcopy(value) if mode == "python" else value


def trajectory_dump(trajectory: Any, mode: str = "python") -> dict[str, Any]:
    """ART's ``Trajectory.model_dump()``: every field but ``start_time`` (ART excludes it);
    ``reward`` is None when none was given."""
    return {
        f.name: dump_value(getattr(trajectory, f.name), mode)
        for f in dataclasses.fields(trajectory)
        if f.name != "start_time"
    }


def group_dump(group: Any, mode: str = "python") -> dict[str, Any]:
    return {
        "trajectories": [trajectory_dump(t, mode) for t in group.trajectories],
        "exceptions": [msgspec.to_builtins(e) for e in group.exceptions],
        "metadata": dump_value(group.metadata, mode),
        "metrics": dump_value(group.metrics, mode),
        "logs": list(group.logs),
    }


def _choice_message(item: Any) -> Any:
    """The message of a sampled choice (an OpenAI ``Choice``, or the dict a capture rebuilds),
    or None for a message the agent wrote."""
    if hasattr(item, "message") and hasattr(item, "finish_reason"):
        return item.message
    if isinstance(item, dict) and "message" in item and "finish_reason" in item:
        return item["message"]
    return None


def for_logging(trajectory: Any) -> dict[str, Any]:
    """ART's ``Trajectory.for_logging()``: the messages, each marked ``trainable`` when it is a
    sampled choice, with the reward, metrics, metadata, tools and logs."""
    main = trajectory.sent_conversations()[0]  # a captured trajectory's exchanges as messages
    messages = []
    for item in main.messages_and_choices:
        choice = _choice_message(item)
        message = dump_value(item if choice is None else choice, "json")
        messages.append({**message, "trainable": choice is not None})
    return {
        "reward": dump_value(trajectory.reward),
        "metrics": dict(trajectory.metrics),
        "metadata": dict(trajectory.metadata),
        "messages": messages,
        "tools": dump_value(main.tools, "json"),
        "logs": list(trajectory.logs),
    }


def copy_with(obj: Any, update: dict[str, Any] | None, deep: bool, fresh: tuple[str, ...] = ()) -> Any:
    """``model_copy``: a copy with ``update`` applied; ``fresh`` attributes are not carried over."""
    new = copy.deepcopy(obj) if deep else copy.copy(obj)
    for name in fresh:
        new.__dict__.pop(name, None)
    for key, value in (update or {}).items():
        setattr(new, key, value)
    return new
