"""``POST /v1/responses``: OpenAI's Responses API, said again in chat's terms and served as chat is.

``instructions`` become the system message, ``message`` items turns, ``function_call`` items an
assistant's tool calls and ``function_call_output`` items tool messages; the chat template renders
them. The answer's ``output`` holds one ``message`` item (its ``output_text``, possibly empty) then
one ``function_call`` item per call chat's parser found. The response object carries Artery's
``token_ids``, ``token_logprobs`` and ``prompt_token_ids``; streamed, the standard events are sent,
and the response in ``response.completed`` (the last, whatever the status) carries them. Nothing
is stored: ``previous_response_id`` is refused, the conversation comes whole in ``input``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

import msgspec
from fastapi import Request
from fastapi.responses import Response
from opentelemetry import trace

from artery.services.inference.chat import finite_logprobs
from artery.services.inference.engine.base import Completion
from artery.services.inference.openai_types import (
    ChatCompletionRequest,
    ChatMessage,
    ContentPart,
    FunctionDefinition,
    NamedToolChoice,
    RequestFunctionCall,
    RequestToolCall,
    Tool,
    ToolCall,
    ToolChoice,
    ToolChoiceFunction,
    invalid_request,
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
    named_event,
    sse_response,
    stream_failure,
    traced,
)

# --------------------------------------------------------------------------- request


class FunctionTool(ClientRequest, kw_only=True):
    type: Literal["function"] = "function"
    name: Annotated[str, msgspec.Meta(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class InputMessage(ClientRequest, kw_only=True):
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]


class FunctionCallItem(ClientRequest, kw_only=True):
    call_id: str
    name: str
    arguments: str = "{}"


class FunctionCallOutputItem(ClientRequest, kw_only=True):
    call_id: str
    output: str | list[ContentPart]


class ResponsesRequest(ClientRequest, kw_only=True):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_output_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    stream: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None


# --------------------------------------------------------------------------- response


class ResponseObject(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    error: None = None
    incomplete_details: dict[str, str] | None = None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[dict[str, Any]]
    parallel_tool_calls: bool = True
    temperature: float | None
    top_p: float | None
    tool_choice: Any
    tools: list[dict[str, Any]]
    text: dict[str, Any] = msgspec.field(default_factory=lambda: {"format": {"type": "text"}})
    truncation: str = "disabled"
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    usage: dict[str, Any] | None = None
    #: Artery: the sampled ids, their logprobs, and the rendered prompt's ids.
    token_ids: list[int] | None = None
    token_logprobs: list[float] | None = None
    prompt_token_ids: list[int] | None = None


# --------------------------------------------------------------------------- the route


async def handle(http: Request, state: ServingState) -> Response:
    async def answer(span: trace.Span) -> Response:
        request = decode_body(await http.body(), ResponsesRequest)
        span.set_attribute("artery.requested_model", request.model)
        if request.previous_response_id:
            raise invalid_request(
                "responses are not stored: send the whole conversation in `input`", "previous_response_id"
            )
        chat = as_chat(request)
        generation = chat_generation(state, chat, f"resp_{uuid.uuid4().hex}")
        if request.stream:
            resolved, stream = await generation.stream()
            span.set_attribute("artery.served_name", resolved.served_name)
            head = _response(request, generation.request_id, resolved.served_name)
            head.prompt_token_ids = generation.prompt
            return sse_response(_events(stream, chat, head, state.engine.tokenizer))
        resolved, completions = await generation.run()
        span.set_attribute("artery.served_name", resolved.served_name)
        response = _response(request, generation.request_id, resolved.served_name)
        _finish(response, completions[0], chat, generation.prompt)
        return json_response(response)

    return await traced(http, "inference.response", answer)


def as_chat(request: ResponsesRequest) -> ChatCompletionRequest:
    """The same conversation as a chat request: what the chat template renders."""
    messages: list[ChatMessage] = []
    if request.instructions:
        messages.append(ChatMessage(role="system", content=request.instructions))
    items = [{"role": "user", "content": request.input}] if isinstance(request.input, str) else request.input
    for index, item in enumerate(items):
        _add_item(messages, item, f"input[{index}]")
    if not messages:
        raise invalid_request("`input` must hold at least one item", "input")
    tools = None
    if request.tools:
        tools = [
            Tool(function=FunctionDefinition(name=t.name, description=t.description, parameters=t.parameters))
            for t in request.tools
        ]
    return ChatCompletionRequest(
        model=request.model,
        messages=messages,
        max_tokens=request.max_output_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        tools=tools,
        tool_choice=_tool_choice(request.tool_choice),
    )


def _add_item(messages: list[ChatMessage], item: dict[str, Any], param: str) -> None:
    kind = item.get("type", "message")
    try:
        if kind == "message":
            message = msgspec.convert(item, InputMessage)
            messages.append(ChatMessage(role=message.role, content=_text(message.content, param)))
        elif kind == "function_call":
            call = msgspec.convert(item, FunctionCallItem)
            tool_call = RequestToolCall(
                id=call.call_id, function=RequestFunctionCall(name=call.name, arguments=call.arguments)
            )
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                # What the assistant said and the calls it made (parallel calls too) arrive as
                # consecutive items: one assistant turn holds them all, as chat writes it.
                last.tool_calls = [*(last.tool_calls or []), tool_call]
            else:
                messages.append(ChatMessage(role="assistant", content=None, tool_calls=[tool_call]))
        elif kind == "function_call_output":
            result = msgspec.convert(item, FunctionCallOutputItem)
            output = _text(result.output, param)
            messages.append(ChatMessage(role="tool", content=output, tool_call_id=result.call_id))
        elif kind != "reasoning":  # a model's reasoning summary is not replayed to it
            raise invalid_request(f"input items of type {kind!r} are not supported", param)
    except msgspec.ValidationError as exc:
        raise invalid_request(f"{exc}", param) from None


def _text(content: str | list[ContentPart], param: str) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.type not in ("input_text", "output_text", "text") or part.text is None:
            raise invalid_request(f"content parts of type {part.type!r} are not supported", param)
        parts.append(part.text)
    return "".join(parts)


def _tool_choice(choice: str | dict[str, Any] | None) -> ToolChoice | None:
    if choice is None:
        return None
    if isinstance(choice, dict):
        name = choice.get("name")
        if choice.get("type") != "function" or not isinstance(name, str):
            raise invalid_request("`tool_choice` names a function as {type: function, name}", "tool_choice")
        return NamedToolChoice(function=ToolChoiceFunction(name=name))
    if choice not in ("none", "auto", "required"):
        raise invalid_request(f"`tool_choice` {choice!r} is not one of none, auto, required", "tool_choice")
    return choice  # type: ignore[return-value]


def _response(request: ResponsesRequest, request_id: str, model: str) -> ResponseObject:
    """The response as it starts: in progress, nothing out yet."""
    return ResponseObject(
        id=request_id,
        created_at=int(time.time()),
        status="in_progress",
        instructions=request.instructions,
        max_output_tokens=request.max_output_tokens,
        model=model,
        output=[],
        temperature=request.temperature,
        top_p=request.top_p,
        tool_choice=request.tool_choice or "auto",
        tools=[msgspec.to_builtins(tool) for tool in request.tools or []],
        metadata=request.metadata or {},
    )


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _call_item(call: ToolCall, arguments: str | None = None) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": f"fc_{call.id.removeprefix('call_')}",
        "call_id": call.id,
        "name": call.function.name,
        "arguments": call.function.arguments if arguments is None else arguments,
        "status": "completed" if arguments is None else "in_progress",
    }


def _finish(
    response: ResponseObject, done: Completion, chat: ChatCompletionRequest, prompt: list[int]
) -> None:
    content, calls = parse_tool_calls(done.text, chat.effective_tool_choice)
    message_id = f"msg_{response.id.removeprefix('resp_')}"
    response.output = [_message_item(message_id, content or "", "completed"), *map(_call_item, calls)]
    _complete(response, done.finish_reason, list(done.token_ids), finite_logprobs(done.logprobs), prompt)


def _complete(
    response: ResponseObject, finish: str, ids: list[int], logprobs: list[float], prompt: list[int]
) -> None:
    if finish == "length":
        response.status = "incomplete"
        response.incomplete_details = {"reason": "max_output_tokens"}
    else:
        response.status = "completed"
    response.usage = {
        "input_tokens": len(prompt),
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": len(ids),
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": len(prompt) + len(ids),
    }
    response.token_ids = ids
    response.token_logprobs = logprobs
    response.prompt_token_ids = prompt


class _Events:
    """Numbers the events of one response, as the API does (``sequence_number``)."""

    def __init__(self) -> None:
        self.sequence = 0

    def __call__(self, kind: str, **fields: Any) -> bytes:
        event = named_event(kind, {"type": kind, "sequence_number": self.sequence, **fields})
        self.sequence += 1
        return event


async def _events(
    stream: EngineStream, chat: ChatCompletionRequest, response: ResponseObject, tokenizer: Any
) -> AsyncIterator[bytes]:
    event = _Events()
    choice = chat.effective_tool_choice
    text = StreamedText(tokenizer, chat.stop_strings, TOOL_CALL_START if choice != "none" else None)
    prompt, response.prompt_token_ids = response.prompt_token_ids or [], None
    message_id = f"msg_{response.id.removeprefix('resp_')}"
    place = {"item_id": message_id, "output_index": 0, "content_index": 0}
    try:
        yield event("response.created", response=response)
        yield event("response.in_progress", response=response)
        yield event(
            "response.output_item.added", output_index=0, item=_message_item(message_id, "", "in_progress")
        )
        yield event(
            "response.content_part.added",
            **place,
            part={"type": "output_text", "text": "", "annotations": []},
        )
        said = ""
        async for step in stream.steps():
            if step.index != 0 or text.finished:
                continue
            delta = text.feed(step)
            if delta:
                said += delta
                yield event("response.output_text.delta", **place, delta=delta, logprobs=[])
        content, calls = parse_tool_calls(text.tail, choice) if text.tail else (None, [])
        rest = text.rest() + (content or "")
        if rest:
            said += rest
            yield event("response.output_text.delta", **place, delta=rest, logprobs=[])
        message = _message_item(message_id, said, "completed")
        yield event("response.output_text.done", **place, text=said, logprobs=[])
        yield event("response.content_part.done", **place, part=message["content"][0])
        yield event("response.output_item.done", output_index=0, item=message)
        response.output = [message]
        for index, call in enumerate(calls, start=1):
            item = _call_item(call)
            yield event("response.output_item.added", output_index=index, item=_call_item(call, ""))
            arguments = call.function.arguments
            yield event(
                "response.function_call_arguments.delta",
                item_id=item["id"],
                output_index=index,
                delta=arguments,
            )
            yield event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                arguments=arguments,
            )
            yield event("response.output_item.done", output_index=index, item=item)
            response.output.append(item)
        _complete(response, text.finish_reason, text.token_ids, text.logprobs, prompt)
        # ``response.completed`` even when ``max_output_tokens`` cut it (its status says so), as vLLM
        # sends it: the OpenAI client's stream helper takes its final response from no other event.
        yield event("response.completed", response=response)
    except Exception as exc:
        failure = stream_failure(response.id, exc)
        yield event("error", code="engine_error", message=failure.body.error.message, param=None)
    finally:
        await stream.aclose()
