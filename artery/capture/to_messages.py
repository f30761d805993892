"""An exchange as chat messages and a choice, the form every trajectory trains from.

Each wire API's request becomes the conversation that preceded the answer, and its response one
choice dict carrying the sampled ``token_ids`` / ``token_logprobs`` (Artery's extension fields),
so ``artery.convert`` makes its ``Sample`` exactly as for a chat completion:

- Chat Completions: the request's ``messages`` and ``tools``, the response's first choice.
- Completions: the raw ``prompt`` becomes one user message and the completion text the answer.
  The answer's tokens are the ones sampled; the prompt is rendered by the chat template when
  training, as no raw prompt travels on the wire.
- Responses: ``instructions`` and ``input`` items (messages, ``function_call``,
  ``function_call_output``) become system, user, assistant (with tool calls) and tool messages;
  the ``output`` items one assistant message.
- Anthropic Messages: ``system``, then ``text`` / ``tool_use`` / ``tool_result`` blocks become
  content, tool calls and tool messages; the response's blocks one assistant message.
"""

from __future__ import annotations

import json
from typing import Any

from artery.capture.exchanges import Exchange, Kind, as_data

_FINISH = {"end_turn": "stop", "stop_sequence": "stop", "tool_use": "tool_calls", "max_tokens": "length"}


def conversation(kind: Kind, exchange: Exchange) -> tuple[list[Any], list[Any] | None, dict[str, Any]]:
    """``(messages, tools, choice)`` of one exchange; tools in Chat Completions' shape."""
    request, response = exchange.request, as_data(exchange.response)
    if kind == "chat_completions":
        return list(request.get("messages") or []), request.get("tools"), _chat_choice(response)
    if kind == "completions":
        return _completion(request, response)
    if kind == "responses":
        return _responses(request, response)
    return _anthropic(request, response)


def _chat_choice(response: dict[str, Any]) -> dict[str, Any]:
    choices = response.get("choices") or []
    if not choices:
        raise ValueError("a chat completion without choices")
    return dict(choices[0])


def _choice(message: dict[str, Any], finish_reason: str, extension: dict[str, Any]) -> dict[str, Any]:
    choice = {"index": 0, "message": message, "finish_reason": finish_reason}
    for key in ("token_ids", "token_logprobs"):
        if extension.get(key):
            choice[key] = extension[key]
    return choice


def _text(content: Any) -> str:
    """The text of a content given as a string or a list of parts/blocks."""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content or [] if isinstance(part, dict))


# --------------------------------------------------------------------------- completions


def _completion(request: dict[str, Any], response: dict[str, Any]) -> tuple[list[Any], None, dict[str, Any]]:
    prompt = request.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise ValueError("only a completion of one text prompt trains (not token ids, not a batch)")
    choices = response.get("choices") or []
    if not choices:
        raise ValueError("a completion without choices")
    first = choices[0]
    message = {"role": "assistant", "content": first.get("text") or ""}
    return (
        [{"role": "user", "content": prompt}],
        None,
        _choice(message, first.get("finish_reason") or "stop", first),
    )


# --------------------------------------------------------------------------- responses


def _responses(
    request: dict[str, Any], response: dict[str, Any]
) -> tuple[list[Any], list[Any] | None, dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if request.get("instructions"):
        messages.append({"role": "system", "content": request["instructions"]})
    items = request.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    _response_items(items or [], messages)
    output: list[dict[str, Any]] = []
    _response_items(response.get("output") or [], output)
    answer = output[0] if output else {"role": "assistant", "content": ""}
    if answer.get("role") != "assistant" or len(output) > 1:
        raise ValueError("a response whose output is not one assistant turn")
    calls = bool(answer.get("tool_calls"))
    finish = "tool_calls" if calls else "length" if response.get("status") == "incomplete" else "stop"
    tools = [
        {
            "type": "function",
            "function": {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None},
        }
        for t in request.get("tools") or []
        if t.get("type") == "function"
    ]
    return messages, tools or None, _choice(answer, finish, response)


def _response_items(items: list[Any], into: list[dict[str, Any]]) -> None:
    """Responses items as chat messages: an assistant's text and the function calls that follow
    it are one assistant message, as a chat completion would have returned them."""
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            role = "system" if item.get("role") == "developer" else item.get("role", "user")
            into.append({"role": role, "content": _text(item.get("content"))})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id") or item.get("id", ""),
                "type": "function",
                "function": {"name": item["name"], "arguments": item.get("arguments") or ""},
            }
            if not into or into[-1]["role"] != "assistant":
                into.append({"role": "assistant", "content": None})
            into[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            into.append({"role": "tool", "tool_call_id": item["call_id"], "content": _text(output)})
        # reasoning and other items carry no chat message


# --------------------------------------------------------------------------- anthropic


def _anthropic(
    request: dict[str, Any], response: dict[str, Any]
) -> tuple[list[Any], list[Any] | None, dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if request.get("system"):
        messages.append({"role": "system", "content": _text(request["system"])})
    for message in request.get("messages") or []:
        messages.extend(_anthropic_turn(message["role"], message.get("content")))
    turn = _anthropic_turn("assistant", response.get("content") or [])
    answer = turn[0] if turn else {"role": "assistant", "content": ""}
    finish = _FINISH.get(response.get("stop_reason") or "", "stop")
    tools = [
        {
            "type": "function",
            "function": {
                "name": t["name"],
                **({"description": t["description"]} if t.get("description") else {}),
                "parameters": t.get("input_schema") or {"type": "object"},
            },
        }
        for t in request.get("tools") or []
        if "name" in t
    ]
    return messages, tools or None, _choice(answer, finish, response)


def _anthropic_turn(role: str, content: Any) -> list[dict[str, Any]]:
    """One Anthropic turn as chat messages: tool results first (as tool messages), then the text
    and, for the assistant, its tool calls."""
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    out: list[dict[str, Any]] = []
    text: list[str] = []
    calls: list[dict[str, Any]] = []
    for block in content or []:
        kind = block.get("type")
        if kind == "text":
            text.append(block.get("text", ""))
        elif kind == "tool_use":
            arguments = json.dumps(block.get("input") or {})
            calls.append(
                {
                    "id": block["id"],
                    "type": "function",
                    "function": {"name": block["name"], "arguments": arguments},
                }
            )
        elif kind == "tool_result":
            out.append(
                {"role": "tool", "tool_call_id": block["tool_use_id"], "content": _text(block.get("content"))}
            )
    if role == "assistant":
        message: dict[str, Any] = {
            "role": "assistant",
            "content": "".join(text) if text or not calls else None,
        }
        if calls:
            message["tool_calls"] = calls
        out.append(message)
    elif text:
        out.append({"role": role, "content": "".join(text)})
    return out
