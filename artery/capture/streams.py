"""A streamed response (server-sent events) put back together into the body the same call
would have returned unstreamed, for each wire API, extension fields included."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from artery.capture.exchanges import Kind
from artery.completion_bodies import choice_from_sse


def events(content: bytes) -> Iterator[dict[str, Any]]:
    """The JSON payloads of a stream's ``data:`` lines, up to ``[DONE]``."""
    for line in content.decode("utf-8").splitlines():
        if not line.startswith("data:"):
            continue
        data = line.removeprefix("data:").strip()
        if data == "[DONE]":
            return
        if data:
            yield json.loads(data)


def reassemble(kind: Kind, content: bytes) -> dict[str, Any] | None:
    """The final response; ``None`` when the stream stopped before it was complete."""
    if kind == "chat_completions":
        return _chat(content)
    if kind == "completions":
        return _completion(content)
    if kind == "responses":
        return _response(content)
    return _message(content)


def _chat(content: bytes) -> dict[str, Any] | None:
    parsed = choice_from_sse(content)  # only the first choice: n > 1 streams record one
    if parsed is None:
        return None
    choice, served = parsed
    first = next(events(content), {})
    usage = None
    for chunk in events(content):
        usage = chunk.get("usage") or usage
    body = {
        "id": first.get("id", ""),
        "object": "chat.completion",
        "created": first.get("created", 0),
        "model": served or "",
        "choices": [choice],
    }
    if usage:
        body["usage"] = usage
    return body


def _completion(content: bytes) -> dict[str, Any] | None:
    """Legacy completions: text, ids and logprobs arrive per chunk; the prompt's ids once."""
    head: dict[str, Any] = {}
    text: list[str] = []
    choice: dict[str, Any] = {"index": 0, "finish_reason": None}
    lists: dict[str, list[Any]] = {"token_ids": [], "token_logprobs": []}
    legacy: dict[str, list[Any]] = {}
    for chunk in events(content):
        head = head or chunk
        head["usage"] = chunk.get("usage") or head.get("usage")
        for part in chunk.get("choices") or []:
            if part.get("index", 0) != 0:
                continue
            text.append(part.get("text") or "")
            for key in lists:
                lists[key].extend(part.get(key) or [])
            if part.get("prompt_token_ids"):
                choice["prompt_token_ids"] = part["prompt_token_ids"]
            for key, values in (part.get("logprobs") or {}).items():
                legacy.setdefault(key, []).extend(values or [])
            choice["finish_reason"] = part.get("finish_reason") or choice["finish_reason"]
    if choice["finish_reason"] is None:
        return None
    choice.update(text="".join(text), logprobs=legacy or None)
    choice.update({key: values for key, values in lists.items() if values})
    body = {key: head.get(key) for key in ("id", "created", "model", "system_fingerprint", "usage")}
    return {
        **{k: v for k, v in body.items() if v is not None},
        "object": "text_completion",
        "choices": [choice],
    }


def _response(content: bytes) -> dict[str, Any] | None:
    """The Responses API sends the whole response with its last event."""
    final = None
    for event in events(content):
        if event.get("type") in ("response.completed", "response.incomplete"):
            final = event.get("response")
    return final


def _message(content: bytes) -> dict[str, Any] | None:
    """Anthropic Messages: ``message_start``, then blocks in pieces, then ``message_delta`` with
    the stop reason, the usage and (Artery's) the whole message's token ids and logprobs."""
    message: dict[str, Any] | None = None
    blocks: dict[int, dict[str, Any]] = {}
    partial_json: dict[int, list[str]] = {}
    stopped = False
    for event in events(content):
        kind = event.get("type")
        if kind == "message_start":
            message = dict(event["message"])
        elif kind == "content_block_start":
            blocks[event["index"]] = dict(event["content_block"])
        elif kind == "content_block_delta":
            _apply_delta(blocks.setdefault(event["index"], {}), event["delta"], partial_json, event["index"])
        elif kind == "message_delta" and message is not None:
            delta = event.get("delta") or {}
            message.update({k: v for k, v in delta.items() if k in ("stop_reason", "stop_sequence")})
            message["usage"] = {**(message.get("usage") or {}), **(event.get("usage") or {})}
            for key in ("token_ids", "token_logprobs"):
                found = event.get(key) or delta.get(key)
                if found:
                    message[key] = found
        elif kind == "message_stop":
            stopped = True
    if message is None or not stopped:
        return None
    for index, pieces in partial_json.items():
        blocks[index]["input"] = json.loads("".join(pieces) or "{}")
    message["content"] = [blocks[i] for i in sorted(blocks)]
    return message


def _apply_delta(
    block: dict[str, Any], delta: dict[str, Any], partial: dict[int, list[str]], index: int
) -> None:
    kind = delta.get("type")
    if kind == "text_delta":
        block["text"] = block.get("text", "") + delta.get("text", "")
    elif kind == "input_json_delta":
        partial.setdefault(index, []).append(delta.get("partial_json", ""))
    elif kind == "thinking_delta":
        block["thinking"] = block.get("thinking", "") + delta.get("thinking", "")
    elif kind == "signature_delta":
        block["signature"] = delta.get("signature", "")
