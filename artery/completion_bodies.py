"""A chat completion's response body read back as its first choice: a JSON body, or a stream of
server-sent events put back together (content, tool calls, logprobs, token ids and their logprobs)
the way the OpenAI client does. What ``artery.auto_trajectory`` records of each call it sees."""

from __future__ import annotations

import json
import re
from typing import Any

#: The end of a server-sent event stream, at the start of a line.
SSE_DONE = re.compile(rb"(?:^|\n)data: ?\[DONE\]")


def choice_from_json(content: bytes) -> tuple[dict[str, Any], str | None] | None:
    payload = json.loads(content)
    choices = payload.get("choices") or []
    if not choices:
        return None
    return choices[0], payload.get("model")


def choice_from_sse(content: bytes) -> tuple[dict[str, Any], str | None] | None:
    """The first choice of a streamed completion, put together from its chunks; ``None`` when
    the stream never finished it."""
    served: str | None = None
    seen = False
    role = "assistant"
    text: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    entries: list[Any] = []
    token_ids: list[int] = []
    token_logprobs: list[float] = []
    finish_reason: str | None = None
    for line in content.decode("utf-8").splitlines():
        if not line.startswith("data:"):
            continue
        data = line.removeprefix("data:").strip()
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        served = chunk.get("model") or served
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            seen = True
            delta = choice.get("delta") or {}
            role = delta.get("role") or role
            if delta.get("content"):
                text.append(delta["content"])
            for call in delta.get("tool_calls") or []:
                _merge_tool_call(calls.setdefault(call.get("index", len(calls)), {}), call)
            entries.extend((choice.get("logprobs") or {}).get("content") or [])
            token_ids.extend(choice.get("token_ids") or [])
            token_logprobs.extend(choice.get("token_logprobs") or [])
            finish_reason = choice.get("finish_reason") or finish_reason
    if not seen or finish_reason is None:
        return None
    message: dict[str, Any] = {"role": role, "content": "".join(text) if text or not calls else None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    choice = {
        "index": 0,
        "message": message,
        "finish_reason": finish_reason,
        "logprobs": {"content": entries} if entries else None,
    }
    if token_ids:
        choice["token_ids"] = token_ids
    if token_logprobs:
        choice["token_logprobs"] = token_logprobs
    return choice, served


def _merge_tool_call(into: dict[str, Any], delta: dict[str, Any]) -> None:
    """OpenAI's streaming rule: ids and types are set once, names and arguments arrive in pieces."""
    into.setdefault("id", "")
    into.setdefault("type", "function")
    function = into.setdefault("function", {"name": "", "arguments": ""})
    if delta.get("id"):
        into["id"] = delta["id"]
    if delta.get("type"):
        into["type"] = delta["type"]
    piece = delta.get("function") or {}
    function["name"] += piece.get("name") or ""
    function["arguments"] += piece.get("arguments") or ""


def as_choice(data: dict[str, Any]) -> Any:
    """An OpenAI ``Choice``, as ART records it (``token_ids`` and ``token_logprobs`` stay, as extra
    fields)."""
    try:
        from openai.types.chat.chat_completion import Choice
    except ImportError:
        return data
    try:
        return Choice.model_validate(data)
    except ValueError:  # pydantic's ValidationError: keep the dict, which convert reads as well
        return data
