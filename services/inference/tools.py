"""Tool calls written by the model in the Hermes / Qwen format, turned into OpenAI ``tool_calls``.

The model writes, possibly several in a row and possibly after some prose::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

This is the format of vLLM's ``hermes`` parser, which ART serves with. Whatever cannot be read as a
call (invalid JSON, no name, a name the request's ``tool_choice`` does not allow) stays in the text
content as the model wrote it: a malformed call is data for training, never a server error. So
does a call nesting deeper than ``codec.MAX_NESTING`` (parsing it would recurse past Python's limit).
"""

from __future__ import annotations

import json
import re
import secrets
from typing import NamedTuple

from artery.services.inference.openai_types import FunctionCall, NamedToolChoice, ToolCall, ToolChoice
from artery.shared.codec import json_nesting_exceeds

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"

# A block ends at its closing tag, or at the end of the text when the model stopped before writing it.
_BLOCK = re.compile(re.escape(TOOL_CALL_START) + r"(.*?)(?:" + re.escape(TOOL_CALL_END) + r"|\Z)", re.DOTALL)


class ParsedOutput(NamedTuple):
    #: The text around the calls, stripped; None when calls were found and nothing else was said.
    content: str | None
    tool_calls: list[ToolCall]


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def parse_tool_calls(text: str, tool_choice: ToolChoice = "auto") -> ParsedOutput:
    """Split generated ``text`` into content and tool calls.

    ``tool_choice`` ``"none"`` never parses; a named choice accepts only calls to that function;
    ``"auto"`` and ``"required"`` accept any name (generation is not constrained, so ``"required"``
    cannot force a call). Without any accepted call, ``text`` comes back unchanged.
    """
    if tool_choice == "none" or TOOL_CALL_START not in text:
        return ParsedOutput(text, [])
    only = tool_choice.function.name if isinstance(tool_choice, NamedToolChoice) else None
    calls: list[ToolCall] = []
    kept: list[str] = []
    position = 0
    for match in _BLOCK.finditer(text):
        call = _read_call(match.group(1), only)
        if call is None:
            continue  # left in place: it is part of the content
        kept.append(text[position : match.start()])
        position = match.end()
        calls.append(call)
    if not calls:
        return ParsedOutput(text, [])
    kept.append(text[position:])
    content = "".join(kept).strip()
    return ParsedOutput(content or None, calls)


def _read_call(body: str, only: str | None) -> ToolCall | None:
    if json_nesting_exceeds(body):
        return None
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict):
        return None
    name = data.get("name")
    if not isinstance(name, str) or not name or (only is not None and name != only):
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    if not isinstance(arguments, str):  # an object, as Hermes writes it; a string is already JSON
        arguments = json.dumps(arguments, ensure_ascii=False)
    return ToolCall(id=new_call_id(), function=FunctionCall(name=name, arguments=arguments))
