"""OpenAI chat-completions shapes as msgspec Structs: what clients send, and what we answer.

Requests are decoded with msgspec (unknown fields are ignored, as OpenAI-compatible servers do);
range checks live in the types (``Meta``), cross-field checks in ``check_request``. Responses
encode to OpenAI's exact JSON shape, plus Artery's extensions, which official clients keep as
extra fields (``choice.model_extra["token_ids"]``, ``response.model_extra["prompt_token_ids"]``):

- every choice carries ``token_ids``, the ids the engine sampled (special end tokens included), so
  training uses exactly what was sampled instead of re-tokenising the text;
- every choice carries ``token_logprobs``, each sampled token's logprob, whether or not the client
  asked for ``logprobs`` (see ``Choice.token_logprobs``): what makes every completion trainable;
- the response carries ``prompt_token_ids``, the rendered prompt the completion continues;
- every logprob entry (and each of its ``top_logprobs``) carries ``token_id``.

In a stream, each chunk's choice carries the ``token_ids`` and ``token_logprobs`` of the tokens that
chunk covers, and the first chunk carries ``prompt_token_ids``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from artery.schemas.trajectory import TokenId


class Request(msgspec.Struct, kw_only=True):
    """Base of everything a client sends: unknown fields are ignored. (``kw_only`` is not inherited,
    so each Struct repeats it.)"""


# --------------------------------------------------------------------------- requests


class ContentPart(Request, kw_only=True):
    type: str
    text: str | None = None


class RequestFunctionCall(Request, kw_only=True):
    name: str
    #: A JSON string, as OpenAI requires: an object is a 400 naming this field, as OpenAI answers it.
    arguments: str = "{}"


class RequestToolCall(Request, kw_only=True):
    id: str = ""
    type: Literal["function"] = "function"
    function: RequestFunctionCall


class ChatMessage(Request, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[RequestToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class FunctionDefinition(Request, kw_only=True):
    name: Annotated[str, msgspec.Meta(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Request, kw_only=True):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ToolChoiceFunction(Request, kw_only=True):
    name: str


class NamedToolChoice(Request, kw_only=True):
    type: Literal["function"] = "function"
    function: ToolChoiceFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class StreamOptions(Request, kw_only=True):
    include_usage: bool = False


class TextFormat(Request, kw_only=True, tag_field="type", tag="text"):
    pass


class JsonObjectFormat(Request, kw_only=True, tag_field="type", tag="json_object"):
    pass


class JsonSchema(Request, kw_only=True):
    name: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class JsonSchemaFormat(Request, kw_only=True, tag_field="type", tag="json_schema"):
    json_schema: JsonSchema


#: OpenAI's ``response_format``, told apart by ``type``.
ResponseFormat = TextFormat | JsonObjectFormat | JsonSchemaFormat


class ChatCompletionRequest(Request, kw_only=True):
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    model: str
    n: Annotated[int, msgspec.Meta(ge=1, le=16)] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    max_completion_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    stop: str | Annotated[list[str], msgspec.Meta(max_length=16)] | None = None
    #: A signed 64-bit integer, as engines take it (a larger one would fail in the engine, as a 500).
    seed: Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    #: vLLM's extension: extra variables for the chat template (``{"enable_thinking": false}``).
    chat_template_kwargs: dict[str, Any] | None = None
    # Range-checked as OpenAI does, so that a client learns of a value out of range (1e308) from a
    # 400 naming it. The engines do not apply these yet (``SamplingParams`` has no such fields).
    frequency_penalty: Annotated[float, msgspec.Meta(ge=-2, le=2)] | None = None
    presence_penalty: Annotated[float, msgspec.Meta(ge=-2, le=2)] | None = None
    # Keys: token ids (JSON object keys are strings of digits), checked against the tokenizer's
    # vocabulary once the request is decoded.
    logit_bias: dict[TokenId, Annotated[float, msgspec.Meta(ge=-100, le=100)]] | None = None
    response_format: ResponseFormat | None = None

    @property
    def completion_limit(self) -> int | None:
        """``max_completion_tokens`` (OpenAI's current name) or the older ``max_tokens``."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def effective_tool_choice(self) -> ToolChoice:
        """What the model may do with tools: ``none`` without tools, ``auto`` when unset."""
        if not self.tools:
            return "none"
        return self.tool_choice if self.tool_choice is not None else "auto"


# --------------------------------------------------------------------------- errors


class ErrorBody(msgspec.Struct, kw_only=True):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct, kw_only=True):
    error: ErrorBody


class ApiError(Exception):
    """An error answered in OpenAI's shape, ``{"error": {message, type, param, code}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body = ErrorResponse(error=ErrorBody(message=message, type=type, param=param, code=code))
        self.headers = headers or {}


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def check_request(request: ChatCompletionRequest) -> None:
    """Checks that span several fields (ranges are checked while decoding); raises ``ApiError``."""
    if request.top_logprobs and not request.logprobs:
        raise invalid_request("`top_logprobs` requires `logprobs` to be true", "top_logprobs")
    if any(s == "" for s in request.stop_strings):
        raise invalid_request("stop strings must not be empty", "stop")
    choice = request.tool_choice
    if choice is not None and choice not in ("none", "auto") and not request.tools:
        raise invalid_request("`tool_choice` needs `tools`", "tool_choice")
    if isinstance(choice, NamedToolChoice):
        names = {tool.function.name for tool in request.tools or []}
        if choice.function.name not in names:
            raise invalid_request(
                f"`tool_choice` names {choice.function.name!r}, which is not among `tools`", "tool_choice"
            )


# --------------------------------------------------------------------------- responses


class Response(msgspec.Struct, kw_only=True):
    """Base of what we send. Every field is written, ``null`` included, except in Structs marked
    ``omit_defaults``, where fields still at their default are left out (as OpenAI does)."""


class TopLogprob(Response, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None
    #: Artery: the token's id.
    token_id: int


class LogprobEntry(Response, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]
    #: Artery: the sampled token's id.
    token_id: int


class ChoiceLogprobs(Response, kw_only=True):
    content: list[LogprobEntry] | None
    refusal: list[LogprobEntry] | None = None


class FunctionCall(Response, kw_only=True):
    name: str
    #: JSON-encoded arguments.
    arguments: str


class ToolCall(Response, kw_only=True):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ResponseMessage(Response, kw_only=True, omit_defaults=True):
    role: Literal["assistant"]
    content: str | None
    refusal: str | None
    tool_calls: list[ToolCall] | None = None


FinishReason = Literal["stop", "length", "tool_calls"]


class Choice(Response, kw_only=True):
    index: int
    message: ResponseMessage
    logprobs: ChoiceLogprobs | None
    finish_reason: FinishReason
    #: Artery: the sampled token ids of this completion.
    token_ids: list[int]
    #: Artery: the logprob of each of ``token_ids`` under the sampling distribution, always sent.
    #: ART's server forces ``logprobs=True`` on every request, so ART's agents never ask and its
    #: trainer always has them; forcing the standard field here would change what every OpenAI
    #: client sees (and make ``top_logprobs`` checks lie). An extra field beside ``token_ids``
    #: keeps the standard shape unless asked for, while the OpenAI client keeps it in
    #: ``choice.model_extra`` and ``artery.convert`` makes the choice's sample from it, so a
    #: trajectory built from any completion trains on exactly what was sampled.
    token_logprobs: list[float]
    #: Artery: ``<model>@<step>``, the policy that sampled it (kept with the choice when an agent
    #: appends it to a trajectory: the trainer measures each sample's staleness by it).
    served_model: str | None = None


class Usage(Response, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletion(Response, kw_only=True):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[Choice]
    usage: Usage
    #: Artery: the rendered prompt's token ids.
    prompt_token_ids: list[int]


class DeltaFunctionCall(Response, kw_only=True):
    name: str
    arguments: str


class DeltaToolCall(Response, kw_only=True):
    index: int
    id: str
    type: Literal["function"] = "function"
    function: DeltaFunctionCall


class Delta(Response, kw_only=True, omit_defaults=True):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChunkChoice(Response, kw_only=True, omit_defaults=True):
    index: int
    delta: Delta
    logprobs: ChoiceLogprobs | None
    finish_reason: FinishReason | None
    #: Artery: the ids of the tokens this chunk covers.
    token_ids: list[int] | None = None
    #: Artery: their logprobs, always sent (as ``Choice.token_logprobs``).
    token_logprobs: list[float] | None = None


class ChatCompletionChunk(Response, kw_only=True, omit_defaults=True):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    system_fingerprint: str | None
    choices: list[ChunkChoice]
    usage: Usage | None = None
    #: Artery: the rendered prompt's token ids (first chunk only).
    prompt_token_ids: list[int] | None = None


class ModelCard(Response, kw_only=True):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "artery"
    #: vLLM's extension: the longest prompt + completion, in tokens.
    max_model_len: int | None = None


class ModelList(Response, kw_only=True):
    object: Literal["list"] = "list"
    data: list[ModelCard]
