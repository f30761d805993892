"""What the wire APIs beside chat (``completions``, ``responses``, ``messages``) share with it.

One engine path for every API: a name resolved to ``<model>@<step>`` (an unknown one fails before
waiting out a pause), the request admitted by the pause gate, then generated plainly or streamed.
Each request runs in a SERVER span and counts in the queue depth until its last byte, as chat's.
The streamed text goes through chat's own ``Detokenizer`` and ``TextFilter``, so stop strings and
``<tool_call>`` are held back the same way whichever API asked.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from opentelemetry import trace

from artery.services.inference.chat import finite_logprobs, render_prompt, sampling_params
from artery.services.inference.engine.base import (
    Completion,
    EngineError,
    GenerationRequest,
    SamplingParams,
    TokenStep,
    UnknownAdapter,
)
from artery.services.inference.openai_types import (
    ApiError,
    ChatCompletionRequest,
    Usage,
    check_request,
    invalid_request,
)
from artery.services.inference.serving import EnginePaused, ModelNotFound, Resolved, ServingState
from artery.services.inference.streaming import Detokenizer, EngineStream, TextFilter
from artery.shared.codec import NestedTooDeeply, check_json
from artery.shared.errors import InvalidMessage
from artery.shared.logs import get_logger
from artery.shared.metrics import REPLICA_QUEUE_DEPTH
from artery.shared.tracing import extract, tracer

log = get_logger(__name__)
_tracer = tracer("inference")
T = TypeVar("T")


# msgspec names the place at fault as `$.a[0].b`; the param is the path without `$.` and `[...]`.
_ERROR_PATH = re.compile(r" - at (?:`key` in )?`\$\.?(.*)`$")
_MISSING = re.compile(r"Object missing required field `([^`]+)`")


def decode_body(body: bytes, kind: type[T]) -> T:
    """A request body as ``kind``; any problem is a 400 naming the JSON path at fault (as chat's)."""
    try:
        check_json(body)
    except InvalidMessage as exc:
        code = "nested_too_deeply" if isinstance(exc, NestedTooDeeply) else None
        raise invalid_request(f"The request body is refused: {exc.reason}", code=code) from None
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        path = _ERROR_PATH.search(str(exc))
        param = path.group(1).replace("[...]", "") if path else ""
        if missing := _MISSING.match(str(exc)):  # the field itself is the param, as OpenAI names it
            param = f"{param}.{missing.group(1)}" if param else missing.group(1)
        raise invalid_request(str(exc), param or None) from None
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise invalid_request(f"The request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise invalid_request("The request body is nested too deeply") from None


def json_response(payload: object, status: int = 200) -> Response:
    return Response(msgspec.json.encode(payload), status, media_type="application/json")


def sse_response(events: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def named_event(name: str, payload: object) -> bytes:
    """One server-sent event with an ``event:`` line, as the Responses and Messages APIs send."""
    return b"event: " + name.encode() + b"\ndata: " + msgspec.json.encode(payload) + b"\n\n"


async def traced(
    http: Request, span_name: str, handle: Callable[[trace.Span], Awaitable[Response]]
) -> Response:
    """``handle`` in a SERVER span continuing the caller's trace, counted in the queue depth; a
    streamed answer ends both with its last byte."""
    span = _tracer.start_span(span_name, context=extract(http.headers), kind=trace.SpanKind.SERVER)
    streaming = False
    REPLICA_QUEUE_DEPTH.inc()
    try:
        with trace.use_span(span, record_exception=True, set_status_on_exception=True):
            try:
                response = await handle(span)
            except ApiError as exc:
                span.set_attribute("http.response.status_code", exc.status)
                raise
        span.set_attribute("http.response.status_code", response.status_code)
        if isinstance(response, StreamingResponse):
            response.body_iterator = _ending(response.body_iterator, span)
            streaming = True
        return response
    finally:
        if not streaming:
            span.end()
            REPLICA_QUEUE_DEPTH.dec()


async def _ending(chunks: AsyncIterable[Any], span: trace.Span) -> AsyncIterator[Any]:
    try:
        async for chunk in chunks:
            yield chunk
    finally:
        span.end()
        REPLICA_QUEUE_DEPTH.dec()


@contextlib.contextmanager
def translate_errors() -> Iterator[None]:
    """The serving layer's and the engine's exceptions as OpenAI errors."""
    try:
        yield
    except ApiError:
        raise
    except ModelNotFound as exc:
        raise ApiError(404, str(exc), param="model", code="model_not_found") from None
    except UnknownAdapter as exc:  # unloaded between resolving the name and generating
        raise ApiError(
            404, f"The model's adapter is not loaded: {exc}", param="model", code="model_not_found"
        ) from None
    except EnginePaused as exc:
        retry_after = exc.retry_after
        raise ApiError(
            503,
            str(exc) or "Inference is paused for training and stayed paused past the wait limit",
            type="server_error",
            code="engine_paused",
            headers={"Retry-After": str(max(1, round(retry_after)))} if retry_after else None,
        ) from None
    except EngineError as exc:
        log.error("engine error", error=repr(exc))
        raise ApiError(500, f"The engine failed: {exc}", type="server_error", code="engine_error") from None
    except Exception as exc:
        log.exception("engine failure")
        raise ApiError(
            500, f"The engine failed: {type(exc).__name__}: {exc}", type="server_error", code="engine_error"
        ) from None


def openai_usage(prompt_tokens: int, generated: int) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens, completion_tokens=generated, total_tokens=prompt_tokens + generated
    )


def stream_failure(request_id: str, exc: Exception) -> ApiError:
    """An engine failure after the first byte, told in the stream (the status is already sent)."""
    log.error("stream failed", request_id=request_id, error=repr(exc))
    return ApiError(
        500, f"The engine failed while streaming: {exc}", type="server_error", code="engine_error"
    )


def completion_budget(
    requested: int | None, prompt_tokens: int, max_context: int, default_max_tokens: int, param: str
) -> int:
    """How many tokens may be generated; a prompt that leaves too little room is a 400."""
    room = max_context - prompt_tokens
    if requested is None:
        if room < 1:
            raise invalid_request(
                f"This model's maximum context length is {max_context} tokens, and the prompt takes "
                f"{prompt_tokens}, which leaves no room for a completion.",
                param,
                "context_length_exceeded",
            )
        return min(room, default_max_tokens)
    if requested > room:
        raise invalid_request(
            f"This model's maximum context length is {max_context} tokens. However, you requested "
            f"{prompt_tokens + requested} tokens ({prompt_tokens} in the prompt, {requested} in the "
            "completion). Please reduce the length of the prompt or completion.",
            param,
            "context_length_exceeded",
        )
    return requested


def chat_generation(state: ServingState, request: ChatCompletionRequest, request_id: str) -> Generation:
    """A request another API said in chat's terms, rendered with the chat template as chat's is."""
    check_request(request)
    engine = state.engine
    with translate_errors():
        state.resolve(request.model)  # an unknown name fails before the prompt is rendered
    prompt = render_prompt(engine.tokenizer, request, engine.max_context)
    params = sampling_params(request, len(prompt), engine.max_context, state.default_max_tokens)
    return Generation(state, request.model, prompt, params, request_id)


def matched_stop(tokenizer: Any, token_ids: list[int], stops: tuple[str, ...]) -> str | None:
    """The stop string that ended a completion, if one did (its ids run up to the stop string)."""
    if not stops:
        return None
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    found = [(at, stop) for stop in stops if (at := text.find(stop)) >= 0]
    return min(found)[1] if found else None


@dataclass
class Generation:
    """One request on its way to the engine: the name asked for, the prompt, the parameters."""

    state: ServingState
    model: str
    prompt: list[int]
    params: SamplingParams
    request_id: str

    def check_model(self) -> None:
        """An unknown name fails now, not after waiting out a pause."""
        with translate_errors():
            self.state.resolve(self.model)

    def _prepare(self) -> tuple[Resolved, GenerationRequest]:
        # Resolved once admitted: a request held by a pause gets the adapter loaded during it.
        resolved = self.state.resolve(self.model)
        request = GenerationRequest(
            prompt_token_ids=self.prompt,
            params=self.params,
            adapter=resolved.adapter,
            request_id=self.request_id,
        )
        return resolved, request

    async def run(self) -> tuple[Resolved, list[Completion]]:
        """Every completion, sorted by index."""

        async def once() -> tuple[Resolved, list[Completion]]:
            async with self.state.admit():
                resolved, request = self._prepare()
                return resolved, await self.state.engine.generate(request)

        with translate_errors():
            try:
                resolved, completions = await once()
            except UnknownAdapter:
                # The bare name's newest step was retired while the request waited: once more
                # with what is newest now (as chat does); a retired ``<model>@<step>`` stays a 404.
                if self.model != self.state.model:
                    raise
                resolved, completions = await once()
        return resolved, sorted(completions, key=lambda c: c.index)

    async def stream(self) -> tuple[Resolved, EngineStream]:
        """The engine's token stream, admitted and with its first token out."""
        stream = EngineStream(self.state.engine, self.state.admit, self._prepare)
        with translate_errors():
            resolved = await stream.start()
        return resolved, stream


class StreamedText:
    """One completion's streamed tokens as text deltas: stop strings and, when tools are on,
    everything from ``<tool_call>`` held back (``tail``) for the tool-call parser."""

    def __init__(self, tokenizer: Any, stops: tuple[str, ...], marker: str | None) -> None:
        self._detokenizer = Detokenizer(tokenizer)
        self._filter = TextFilter(stops, marker)
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.finished = False
        #: ``stop`` (a stop string or the end token) or ``length``, once finished.
        self.finish_reason = "stop"
        #: Whether a stop string (not the end token) ended it.
        self.hit_stop = False

    def feed(self, step: TokenStep) -> str:
        """The text ``step`` lets out (often none yet); ignored once finished (the engine may go
        on past a stop string)."""
        if self.finished:
            return ""
        self.token_ids.append(step.token_id)
        self.logprobs.extend(finite_logprobs([step.logprob]))
        text = self._filter.feed(self._detokenizer.add(step.token_id))
        done = step.finish_reason is not None or self._filter.stopped
        if done and not self._filter.stopped:
            text += self._filter.feed(self._detokenizer.flush())
        if done:
            text += self._filter.finish()
            self.finished = True
            self.hit_stop = self._filter.stopped
            self.finish_reason = "stop" if self._filter.stopped else (step.finish_reason or "stop")
        return text

    def rest(self) -> str:
        """What was held back and may now be sent (the tool-call tail aside)."""
        self.finished = True
        return self._filter.finish()

    @property
    def tail(self) -> str:
        return self._filter.tail
