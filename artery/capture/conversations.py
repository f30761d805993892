"""A trajectory's exchanges as the conversations training sees: a call whose messages continue a
conversation already built (its messages first, each recorded answer standing for the assistant
message the agent sent back, the same tools) extends it; any other call starts another. The
longest is the trajectory's own; the others its additional histories."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

import msgspec

from artery import convert
from artery.capture.exchanges import TrajectoryExchanges
from artery.capture.to_messages import conversation
from artery.shared.served_name import parse_served_name

log = logging.getLogger(__name__)


@dataclass
class Conversation:
    messages_and_choices: list[Any] = field(default_factory=list)
    tools: list[Any] | None = None


def conversations(exchanges: TrajectoryExchanges) -> list[Conversation]:
    """The conversations, the longest first (the first one built wins a tie)."""
    ordered = exchanges.in_order()
    spans = _policy_spans_needed(e.model for _, e in ordered)
    built: list[Conversation] = []
    for kind, exchange in ordered:
        try:
            messages, tools, choice = conversation(kind, exchange)
            convert.to_message(choice)  # what sending will do: leave it out now rather than fail then
        except (ValueError, KeyError, TypeError, msgspec.ValidationError) as exc:
            log.warning("capture: a %s exchange is not a chat turn, left out: %s", kind, exc)
            continue
        if exchange.model and not choice.get("served_model"):
            choice["served_model"] = exchange.model  # the policy that sampled it, on its Sample
        if spans:
            _add_policy_span(choice, exchange.model)
        target = next((c for c in built if _continues(c, messages, tools)), None)
        if target is None:
            target = Conversation()
            built.append(target)
        target.messages_and_choices.extend(messages[len(target.messages_and_choices) :])
        target.messages_and_choices.append(choice)
        target.tools = tools
    built.sort(key=lambda c: -len(c.messages_and_choices))
    return built


def _policy_spans_needed(models: Any) -> bool:
    """ART's per-token policy versions matter only when the step changed within the rollout."""
    steps = {parsed[1] for model in models if (parsed := parse_served_name(model or "")) is not None}
    return len(steps) > 1


def _add_policy_span(choice: dict[str, Any], served: str | None) -> None:
    """ART's ``policy_token_spans``: here every answer is sampled by one policy (a replica pauses
    while a step is taken), so one span covers all its tokens."""
    parsed = parse_served_name(served or "")
    count = len(choice.get("token_ids") or [])
    if parsed is None or count == 0:
        return
    choice["policy_token_spans"] = [
        {
            "start_token": 0,
            "end_token": count,
            "policy_version": parsed[1],
            "lora_slot": served,
            "update_seq": parsed[1],
        }
    ]


def _continues(conversation: Conversation, messages: list[Any], tools: Any) -> bool:
    recorded = conversation.messages_and_choices
    if len(recorded) > len(messages):
        return False
    if conversation.tools != tools:
        return False
    return all(_key(a) == _key(b) for a, b in zip(recorded, messages, strict=False))


def _key(item: Any) -> Any:
    """A message as compared between calls: a recorded choice equals the assistant message the
    agent sent back, whatever fields its client added."""
    try:
        message = convert.to_message(item)
    except (ValueError, msgspec.ValidationError):
        return item
    data = msgspec.to_builtins(message)
    data.pop("sample", None)
    data.pop("trainable", None)
    if data.get("role") == "assistant" and data.get("content") is None:
        data["content"] = ""
    for call in data.get("tool_calls") or []:
        function = call.get("function") or {}
        try:  # the same JSON re-serialised (other spacing or key order) is the same call
            function["arguments"] = json.loads(function.get("arguments") or "null")
        except (TypeError, ValueError):
            pass
    return data
