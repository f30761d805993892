"""``POST /v1/messages``: Anthropic's Messages API, for agents written against Anthropic's client.

The request is said again in chat's terms (``system`` first, ``tool_use`` blocks as tool calls,
``tool_result`` blocks as tool messages) and rendered with the chat template, so the model sees
what a chat request with the same turns would show it. The answer is a Message (``text`` and
``tool_use`` blocks, parsed by chat's tool-call parser) that carries Artery's ``token_ids`` and
``token_logprobs`` (and the prompt's ``prompt_token_ids``); streamed, the ``message_delta`` event
carries them for the whole message. Anthropic's ``x-api-key`` header is accepted as the key.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

import msgspec
from fastapi import Request
from fastapi.responses import Response
from opentelemetry import trace

from artery.services.inference.chat import finite_logprobs
from artery.services.inference.openai_types import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionDefinition,
    NamedToolChoice,
    RequestFunctionCall,
    RequestToolCall,
    Tool,
    ToolCall,
    ToolChoice,
    ToolChoiceFunction,
)
from artery.services.inference.openai_types import (
    Request as ClientRequest,
)
from artery.services.inference.serving import ServingState
from artery.services.inference.streaming import EngineStream
from artery.services.inference.tools import TOOL_CALL_START, parse_tool_calls
from artery.services.inference.wire import (
    StreamedText,
    chat_generation,
    decode_body,
    json_response,
    matched_stop,
    named_event,
    sse_response,
    stream_failure,
    traced,
)

# --------------------------------------------------------------------------- request


class TextBlock(ClientRequest, kw_only=True, tag_field="type", tag="text"):
    text: str


class ToolUseBlock(ClientRequest, kw_only=True, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(ClientRequest, kw_only=True, tag_field="type", tag="tool_result"):
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None


Block = TextBlock | ToolUseBlock | ToolResultBlock


class AnthropicMessage(ClientRequest, kw_only=True):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class AnthropicTool(ClientRequest, kw_only=True):
    name: Annotated[str, msgspec.Meta(min_length=1)]
    description: str | None = None
    input_schema: dict[str, Any]


class AnthropicToolChoice(ClientRequest, kw_only=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None


class MessagesRequest(ClientRequest, kw_only=True):
    model: str
    messages: Annotated[list[AnthropicMessage], msgspec.Meta(min_length=1)]
    max_tokens: Annotated[int, msgspec.Meta(ge=1)]
    system: str | list[TextBlock] | None = None
    stop_sequences: Annotated[list[str], msgspec.Meta(max_length=16)] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0, le=1)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    stream: bool | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None


# --------------------------------------------------------------------------- response


class OutText(msgspec.Struct, kw_only=True, tag_field="type", tag="text"):
    text: str


class OutToolUse(msgspec.Struct, kw_only=True, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]


class MessageUsage(msgspec.Struct, kw_only=True):
    input_tokens: int
    output_tokens: int


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class Message(msgspec.Struct, kw_only=True):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[OutText | OutToolUse]
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: MessageUsage
    #: Artery: the sampled ids, their logprobs, and the rendered prompt's ids.
    token_ids: list[int] | None = None
    token_logprobs: list[float] | None = None
    prompt_token_ids: list[int] | None = None


# --------------------------------------------------------------------------- the route


async def handle(http: Request, state: ServingState) -> Response:
    async def answer(span: trace.Span) -> Response:
        request = decode_body(await http.body(), MessagesRequest)
        span.set_attribute("artery.requested_model", request.model)
        chat = as_chat(request)
        generation = chat_generation(state, chat, f"msg_{uuid.uuid4().hex}")
        tokenizer = state.engine.tokenizer
        if request.stream:
            resolved, stream = await generation.stream()
            span.set_attribute("artery.served_name", resolved.served_name)
            head = _message(
                generation.request_id, resolved.served_name, [], None, None, len(generation.prompt), 0
            )
            head.prompt_token_ids = generation.prompt
            return sse_response(_events(stream, chat, head, tokenizer))
        resolved, completions = await generation.run()
        span.set_attribute("artery.served_name", resolved.served_name)
        done = completions[0]
        content, calls = parse_tool_calls(done.text, chat.effective_tool_choice)
        stop = (
            matched_stop(tokenizer, done.token_ids, chat.stop_strings)
            if done.finish_reason == "stop"
            else None
        )
        reason = _stop_reason(done.finish_reason, bool(calls), stop)
        blocks = _blocks(content, calls)
        message = _message(
            generation.request_id,
            resolved.served_name,
            blocks,
            reason,
            stop,
            len(generation.prompt),
            len(done.token_ids),
        )
        message.token_ids = list(done.token_ids)
        message.token_logprobs = finite_logprobs(done.logprobs)
        message.prompt_token_ids = generation.prompt
        return json_response(message)

    return await traced(http, "inference.message", answer)


def as_chat(request: MessagesRequest) -> ChatCompletionRequest:
    """The same conversation as a chat request: what the chat template renders."""
    messages: list[ChatMessage] = []
    if request.system:
        system = (
            request.system if isinstance(request.system, str) else "".join(b.text for b in request.system)
        )
        messages.append(ChatMessage(role="system", content=system))
    for turn in request.messages:
        messages.extend(_turn(turn))
    tools = None
    if request.tools:
        tools = [
            Tool(
                function=FunctionDefinition(name=t.name, description=t.description, parameters=t.input_schema)
            )
            for t in request.tools
        ]
    return ChatCompletionRequest(
        model=request.model,
        messages=messages,
        max_tokens=request.max_tokens,
        stop=request.stop_sequences,
        temperature=request.temperature,
        top_p=request.top_p,
        tools=tools,
        tool_choice=_tool_choice(request.tool_choice),
    )


def _turn(turn: AnthropicMessage) -> list[ChatMessage]:
    if isinstance(turn.content, str):
        return [ChatMessage(role=turn.role, content=turn.content)]
    out: list[ChatMessage] = []
    texts = [block.text for block in turn.content if isinstance(block, TextBlock)]
    calls = [
        RequestToolCall(id=b.id, function=RequestFunctionCall(name=b.name, arguments=json.dumps(b.input)))
        for b in turn.content
        if isinstance(b, ToolUseBlock)
    ]
    for block in turn.content:
        if isinstance(block, ToolResultBlock):
            result = block.content
            text = result if isinstance(result, str) or result is None else "".join(b.text for b in result)
            out.append(ChatMessage(role="tool", content=text or "", tool_call_id=block.tool_use_id))
    if texts or calls:
        out.append(ChatMessage(role=turn.role, content="".join(texts) or None, tool_calls=calls or None))
    return out


def _tool_choice(choice: AnthropicToolChoice | None) -> ToolChoice | None:
    if choice is None:
        return None
    if choice.type == "tool" and choice.name:
        return NamedToolChoice(function=ToolChoiceFunction(name=choice.name))
    return {"auto": "auto", "any": "required", "none": "none"}.get(choice.type, "auto")  # type: ignore[return-value]


def _tool_input(call: ToolCall) -> dict[str, Any]:
    try:
        value = json.loads(call.function.arguments)
    except ValueError:
        value = call.function.arguments
    # Anthropic's input is an object; arguments the model wrote as anything else are kept whole.
    return value if isinstance(value, dict) else {"arguments": value}


def _blocks(content: str | None, calls: list[ToolCall]) -> list[OutText | OutToolUse]:
    blocks: list[OutText | OutToolUse] = [OutText(text=content)] if content else []
    blocks += [OutToolUse(id=c.id, name=c.function.name, input=_tool_input(c)) for c in calls]
    return blocks


def _stop_reason(finish: str, called: bool, stop: str | None) -> StopReason:
    if finish == "length":
        return "max_tokens"
    if called:
        return "tool_use"
    return "stop_sequence" if stop is not None else "end_turn"


def _message(
    request_id: str,
    model: str,
    content: list[OutText | OutToolUse],
    reason: StopReason | None,
    stop: str | None,
    prompt_tokens: int,
    output_tokens: int,
) -> Message:
    return Message(
        id=request_id,
        model=model,
        content=content,
        stop_reason=reason,
        stop_sequence=stop,
        usage=MessageUsage(input_tokens=prompt_tokens, output_tokens=output_tokens),
    )


async def _events(
    stream: EngineStream, chat: ChatCompletionRequest, head: Message, tokenizer: Any
) -> AsyncIterator[bytes]:
    """message_start, the text block's deltas, one block per tool call, message_delta (with the
    whole message's ids and logprobs), message_stop."""
    choice = chat.effective_tool_choice
    text = StreamedText(tokenizer, chat.stop_strings, TOOL_CALL_START if choice != "none" else None)
    try:
        yield named_event("message_start", {"type": "message_start", "message": head})
        yield named_event(
            "content_block_start",
            {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        )
        async for step in stream.steps():
            if step.index != 0 or text.finished:
                continue
            delta = text.feed(step)
            if delta:
                yield _text_delta(delta)
        rest = text.rest()
        content, calls = parse_tool_calls(text.tail, choice) if text.tail else (None, [])
        if rest + (content or ""):
            yield _text_delta(rest + (content or ""))
        yield named_event("content_block_stop", {"type": "content_block_stop", "index": 0})
        for index, call in enumerate(calls, start=1):
            block = {"type": "tool_use", "id": call.id, "name": call.function.name, "input": {}}
            yield named_event(
                "content_block_start", {"type": "content_block_start", "index": index, "content_block": block}
            )
            arguments = {"type": "input_json_delta", "partial_json": json.dumps(_tool_input(call))}
            yield named_event(
                "content_block_delta", {"type": "content_block_delta", "index": index, "delta": arguments}
            )
            yield named_event("content_block_stop", {"type": "content_block_stop", "index": index})
        stop = matched_stop(tokenizer, text.token_ids, chat.stop_strings) if text.hit_stop else None
        reason = _stop_reason(text.finish_reason, bool(calls), stop)
        yield named_event(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": stop},
                "usage": {"output_tokens": len(text.token_ids)},
                "token_ids": text.token_ids,
                "token_logprobs": text.logprobs,
            },
        )
        yield named_event("message_stop", {"type": "message_stop"})
    except Exception as exc:
        failure = stream_failure(head.id, exc)
        body = {"type": "error", "error": {"type": "api_error", "message": failure.body.error.message}}
        yield named_event("error", body)
    finally:
        await stream.aclose()


def _text_delta(text: str) -> bytes:
    delta = {"type": "text_delta", "text": text}
    return named_event("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta})
