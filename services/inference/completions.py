"""``POST /v1/completions``: OpenAI's legacy Completions API, a raw prompt with no chat template.

The prompt (a string, a list of one string, or token ids as vLLM takes them) is tokenised as it is
and continued. As vLLM does, each choice carries the prompt's ids (``prompt_token_ids``), and, as
every chat choice does, the sampled ``token_ids`` and their ``token_logprobs`` (asked or not): the
exact tokens a trainer needs. A streamed choice's chunks carry the ids and logprobs of the tokens
they cover, its first chunk the prompt's ids. ``max_tokens`` defaults to 16, as OpenAI's does.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any

import msgspec
from fastapi import Request
from fastapi.responses import Response
from opentelemetry import trace

from artery.services.inference.chat import MAX_CHARS_PER_TOKEN, TokenPieces, finite_logprobs
from artery.services.inference.engine.base import Completion, SamplingParams
from artery.services.inference.openai_types import (
    ApiError,
    StreamOptions,
    Usage,
    invalid_request,
)
from artery.services.inference.openai_types import (
    Request as ClientRequest,
)
from artery.services.inference.serving import ServingState
from artery.services.inference.streaming import EngineStream
from artery.services.inference.wire import (
    Generation,
    StreamedText,
    completion_budget,
    decode_body,
    json_response,
    sse_response,
    traced,
)
from artery.shared.logs import get_logger

log = get_logger(__name__)

#: OpenAI's default for the legacy API (chat's default is the room left).
DEFAULT_MAX_TOKENS = 16


class CompletionRequest(ClientRequest, kw_only=True):
    model: str
    #: A string, a list of one string, or a list of token ids.
    prompt: str | list[Any]
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    n: Annotated[int, msgspec.Meta(ge=1, le=16)] | None = None
    stop: str | Annotated[list[str], msgspec.Meta(max_length=16)] | None = None
    seed: Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)] | None = None
    #: How many alternatives to return per position (OpenAI allows at most 5).
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=5)] | None = None
    echo: bool | None = None
    suffix: str | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    frequency_penalty: Annotated[float, msgspec.Meta(ge=-2, le=2)] | None = None
    presence_penalty: Annotated[float, msgspec.Meta(ge=-2, le=2)] | None = None

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionLogprobs(msgspec.Struct, kw_only=True):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(msgspec.Struct, kw_only=True, omit_defaults=True):
    text: str
    index: int
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    #: Artery: the sampled ids (in a stream, those this chunk covers) and their logprobs.
    token_ids: list[int] | None = None
    token_logprobs: list[float] | None = None
    #: vLLM's extension: the prompt's ids (in a stream, on each choice's first chunk).
    prompt_token_ids: list[int] | None = None
    #: Artery: ``<model>@<step>``, the policy that sampled it.
    served_model: str | None = None


class TextCompletion(msgspec.Struct, kw_only=True):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: Usage | None = None


async def handle(http: Request, state: ServingState, pieces: TokenPieces) -> Response:
    async def answer(span: trace.Span) -> Response:
        request = decode_body(await http.body(), CompletionRequest)
        span.set_attribute("artery.requested_model", request.model)
        _check(request)
        engine = state.engine
        prompt = _prompt_ids(request, engine.tokenizer, engine.max_context)
        limit = request.max_tokens if request.max_tokens is not None else DEFAULT_MAX_TOKENS
        budget = completion_budget(limit, len(prompt), engine.max_context, limit, "max_tokens")
        params = SamplingParams(
            max_tokens=budget,
            temperature=1.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            n=request.n or 1,
            stop=request.stop_strings,
            seed=request.seed,
            logprobs=request.logprobs is not None,
            top_logprobs=request.logprobs or 0,
        )
        generation = Generation(state, request.model, prompt, params, f"cmpl-{uuid.uuid4().hex}")
        generation.check_model()
        if request.stream:
            resolved, stream = await generation.stream()
            span.set_attribute("artery.served_name", resolved.served_name)
            writer = _Writer(generation.request_id, resolved.served_name)
            return sse_response(_events(stream, request, writer, prompt, engine.tokenizer, pieces))
        resolved, completions = await generation.run()
        span.set_attribute("artery.served_name", resolved.served_name)
        choices = [_choice(c, request, prompt, pieces, resolved.served_name) for c in completions]
        generated = sum(len(c.token_ids) for c in completions)
        usage = Usage(
            prompt_tokens=len(prompt), completion_tokens=generated, total_tokens=len(prompt) + generated
        )
        return json_response(
            TextCompletion(
                id=generation.request_id,
                created=int(time.time()),
                model=resolved.served_name,
                choices=choices,
                usage=usage,
            )
        )

    return await traced(http, "inference.completion", answer)


def _check(request: CompletionRequest) -> None:
    if request.echo:
        raise invalid_request("`echo` is not supported", "echo")
    if request.suffix:
        raise invalid_request("`suffix` is not supported", "suffix")
    if any(s == "" for s in request.stop_strings):
        raise invalid_request("stop strings must not be empty", "stop")


def _prompt_ids(request: CompletionRequest, tokenizer: Any, max_context: int) -> list[int]:
    """The prompt's token ids, exactly as given when given as ids; one prompt per request."""
    prompt = request.prompt
    if isinstance(prompt, list):
        if prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
            try:
                vocabulary = len(tokenizer)
            except TypeError:  # a tokenizer that cannot say its size: only the sign is checked
                vocabulary = None
            if any(t < 0 or (vocabulary is not None and t >= vocabulary) for t in ids):
                raise invalid_request("`prompt` holds a token id outside the vocabulary", "prompt")
            return ids
        if len(prompt) != 1 or not isinstance(prompt[0], str):
            raise invalid_request(
                "`prompt` must be a string, a list of one string, or a list of token ids", "prompt"
            )
        prompt = prompt[0]
    if len(prompt) > max_context * MAX_CHARS_PER_TOKEN:  # too long to be worth tokenising (see chat)
        raise invalid_request(
            f"This model's maximum context length is {max_context} tokens, and the prompt's "
            f"{len(prompt)} characters are more than that many tokens can hold.",
            "prompt",
            "context_length_exceeded",
        )
    ids = list(tokenizer.encode(prompt, add_special_tokens=True))
    if not ids:
        raise invalid_request("`prompt` must not be empty", "prompt")
    return ids


def _logprobs(
    token_ids: list[int], logprobs: list[float], top: list[list[tuple[int, float]]], pieces: TokenPieces
) -> CompletionLogprobs:
    tokens = [pieces.piece(token_id)[0] for token_id in token_ids]
    offsets, at = [], 0
    for token in tokens:
        offsets.append(at)
        at += len(token)
    alternatives = [
        {pieces.piece(alt)[0]: value for alt, value in finite_pairs(top[i] if i < len(top) else [])}
        for i in range(len(token_ids))
    ]
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=finite_logprobs(logprobs),
        top_logprobs=alternatives,
        text_offset=offsets,
    )


def finite_pairs(pairs: list[tuple[int, float]]) -> list[tuple[int, float]]:
    return list(zip([p[0] for p in pairs], finite_logprobs([p[1] for p in pairs]), strict=True))


def _choice(
    completion: Completion, request: CompletionRequest, prompt: list[int], pieces: TokenPieces, served: str
) -> CompletionChoice:
    logprobs = None
    if request.logprobs is not None:
        logprobs = _logprobs(completion.token_ids, completion.logprobs, completion.top_logprobs, pieces)
    return CompletionChoice(
        text=completion.text,
        index=completion.index,
        logprobs=logprobs,
        finish_reason=completion.finish_reason,
        token_ids=list(completion.token_ids),
        token_logprobs=finite_logprobs(completion.logprobs),
        prompt_token_ids=prompt,
        served_model=served,
    )


class _Writer:
    def __init__(self, request_id: str, model: str) -> None:
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())

    def chunk(self, choices: list[CompletionChoice], usage: Usage | None = None) -> bytes:
        payload = TextCompletion(
            id=self.request_id, created=self.created, model=self.model, choices=choices, usage=usage
        )
        return b"data: " + msgspec.json.encode(payload) + b"\n\n"


async def _events(
    stream: EngineStream,
    request: CompletionRequest,
    out: _Writer,
    prompt: list[int],
    tokenizer: Any,
    pieces: TokenPieces,
) -> AsyncIterator[bytes]:
    """Each token's chunk (its text, often empty while a stop string may be starting), each
    choice's finish, the usage when asked, then ``data: [DONE]``."""
    texts = [StreamedText(tokenizer, request.stop_strings, None) for _ in range(request.n or 1)]
    first = [True] * len(texts)
    try:
        async for step in stream.steps():
            text = texts[step.index]
            if text.finished:
                continue
            delta = text.feed(step)
            logprobs = None
            if request.logprobs is not None:
                logprobs = _logprobs([step.token_id], [step.logprob], [step.top_logprobs], pieces)
            yield out.chunk(
                [
                    CompletionChoice(
                        text=delta,
                        index=step.index,
                        logprobs=logprobs,
                        finish_reason=text.finish_reason if text.finished else None,
                        token_ids=[step.token_id],
                        token_logprobs=text.logprobs[-1:],
                        prompt_token_ids=prompt if first[step.index] else None,
                    )
                ]
            )
            first[step.index] = False
        for index, text in enumerate(texts):
            if not text.finished:  # the engine ended without saying why
                rest = text.rest()
                yield out.chunk(
                    [CompletionChoice(text=rest, index=index, logprobs=None, finish_reason="stop")]
                )
        if request.stream_options is not None and request.stream_options.include_usage:
            generated = sum(len(text.token_ids) for text in texts)
            usage = Usage(
                prompt_tokens=len(prompt), completion_tokens=generated, total_tokens=len(prompt) + generated
            )
            yield out.chunk([], usage)
    except Exception as exc:
        log.error("stream failed", request_id=out.request_id, error=repr(exc))
        error = ApiError(
            500, f"The engine failed while streaming: {exc}", type="server_error", code="engine_error"
        )
        yield b"data: " + msgspec.json.encode(error.body) + b"\n\n"
    finally:
        await stream.aclose()
    yield b"data: [DONE]\n\n"
