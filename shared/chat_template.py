"""How a conversation is handed to a tokenizer's chat template, shared by inference and trainer.

The trainer must render a trajectory's context to exactly the tokens the inference replica was
prompted with, or it trains on a prompt the model never saw. Both therefore build the template's
input here: text content, tool-call arguments parsed into objects (templates write
``arguments | tojson``, which would quote a JSON string twice), and no ``null`` fields in tool
definitions for a template to print. Messages and tools are duck-typed: the OpenAI request types
of the inference API and the wire types of ``schemas`` have the same field names.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec


def tool_call_arguments(arguments: str | dict[str, Any]) -> Any:
    """Arguments as an object when they are a JSON object; invalid JSON the model wrote stays a
    string (that is data, not an error)."""
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return arguments
    return parsed if isinstance(parsed, dict) else arguments


def render_tool_calls(tool_calls: Iterable[Any]) -> list[dict[str, Any]]:
    return [
        {
            "id": call.id,
            "type": "function",
            "function": {
                "name": call.function.name,
                "arguments": tool_call_arguments(call.function.arguments),
            },
        }
        for call in tool_calls
    ]


def render_message(message: Any, content: str, *, placeholder: bool = False) -> dict[str, Any]:
    """One message for the template, with ``content`` already reduced to text.

    A ``placeholder`` stands in for an assistant message whose sampled tokens are spliced in
    afterwards: it keeps role, name and tool_call_id, but not the tool calls or reasoning that the
    sampled tokens already contain."""
    rendered: dict[str, Any] = {"role": message.role, "content": content}
    keys = ("name", "tool_call_id") if placeholder else ("name", "tool_call_id", "reasoning_content")
    for key in keys:
        if getattr(message, key) is not None:
            rendered[key] = getattr(message, key)
    if message.tool_calls and not placeholder:
        rendered["tool_calls"] = render_tool_calls(message.tool_calls)
    return rendered


def render_tools(tools: Sequence[Any] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    return [
        {
            "type": tool.type,
            "function": {k: v for k, v in msgspec.structs.asdict(tool.function).items() if v is not None},
        }
        for tool in tools
    ]
