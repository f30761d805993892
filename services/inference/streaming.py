"""``stream=true``: engine tokens as OpenAI ``chat.completion.chunk`` server-sent events.

Text is decoded incrementally and held back while it could still be the start of a stop string
(never sent, as OpenAI does) or of ``<tool_call>``. When tools are on, content streams only up to
the first ``<tool_call>``; the rest is parsed when the choice finishes and sent as one
``delta.tool_calls``. Every chunk that covers tokens carries their ``token_ids`` and
``token_logprobs`` (and the standard ``logprobs`` when asked), so a streamed answer is as trainable
as a plain one, asked or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import msgspec

from artery.services.inference.chat import TokenPieces, finite_logprobs
from artery.services.inference.engine.base import Engine, GenerationRequest, TokenStep
from artery.services.inference.openai_types import (
    ApiError,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChoiceLogprobs,
    ChunkChoice,
    Delta,
    DeltaFunctionCall,
    DeltaToolCall,
    FinishReason,
    Usage,
)
from artery.services.inference.serving import AdmitHook, Resolved
from artery.services.inference.tools import TOOL_CALL_START, parse_tool_calls
from artery.shared.logs import get_logger
from artery.shared.tasks import cancel_and_wait

log = get_logger(__name__)
_END = object()


class EngineStream:
    """``engine.stream()`` run in a task of its own, inside ``admit()``.

    The pause gate sees the request in flight until its last token, whatever the client does, and
    enters and leaves ``admit()`` in one task. ``start()`` returns once admitted and the first token
    is out, so a pause past the limit or a failing engine still gets a proper HTTP status.
    """

    def __init__(
        self, engine: Engine, admit: AdmitHook, prepare: Callable[[], tuple[Resolved, GenerationRequest]]
    ) -> None:
        self._engine = engine
        self._admit = admit
        self._prepare = prepare
        self._queue: asyncio.Queue[Any] = asyncio.Queue()  # unbounded: a slow reader never stalls a drain
        self._admitted: asyncio.Future[Resolved] = asyncio.get_running_loop().create_future()
        self._task: asyncio.Task[None] | None = None
        self._first: Any = _END

    async def start(self) -> Resolved:
        self._task = asyncio.create_task(self._produce())
        try:
            resolved = await self._admitted
            self._first = await self._next()
        except BaseException:
            await self.aclose()
            raise
        return resolved

    async def steps(self) -> AsyncIterator[TokenStep]:
        item = self._first
        while item is not _END:
            yield item
            item = await self._next()

    async def aclose(self) -> None:
        if self._task is not None and not self._task.done():
            await cancel_and_wait(self._task)

    async def _next(self) -> Any:
        item = await self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    async def _produce(self) -> None:
        try:
            async with self._admit():
                resolved, request = self._prepare()
                self._admitted.set_result(resolved)
                steps = self._engine.stream(request)
                if inspect.isawaitable(steps):
                    steps = await steps
                async with contextlib.aclosing(steps):
                    async for step in steps:
                        self._queue.put_nowait(step)
        except asyncio.CancelledError:
            self._admitted.cancel()
            raise
        except Exception as exc:
            if self._admitted.done():
                self._queue.put_nowait(exc)
            else:
                self._admitted.set_exception(exc)
        finally:
            self._queue.put_nowait(_END)


class Detokenizer:
    """Token ids to text deltas, without re-decoding everything each time and without splitting a
    character whose UTF-8 bytes span several tokens."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # start of the window decoded for context
        self._read = 0  # end of what has been returned

    def add(self, token_id: int) -> str:
        self._ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before) :]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True) if ids else ""


class TextFilter:
    """Decides which text may be sent: never a stop string (or text after it), never what could
    still become one, and nothing from ``marker`` on (kept in ``tail`` for the tool-call parser)."""

    def __init__(self, stops: tuple[str, ...], marker: str | None) -> None:
        self.stops = stops
        self.marker = marker
        self.text = ""
        self.sent = 0
        self.marker_at: int | None = None
        self.stopped = False

    def feed(self, delta: str) -> str:
        if self.stopped or not delta:
            return ""
        search_from = max(0, len(self.text) - max((len(s) for s in self.stops), default=1) + 1)
        self.text += delta
        found = [at for s in self.stops if (at := self.text.find(s, search_from)) >= 0]
        if found:
            self.text = self.text[: min(found)]
            self.stopped = True
            return self._release(final=True)
        return self._release(final=False)

    def finish(self) -> str:
        return self._release(final=True)

    @property
    def tail(self) -> str:
        return "" if self.marker_at is None else self.text[self.marker_at :]

    def _release(self, final: bool) -> str:
        if self.marker is not None and self.marker_at is None:
            at = self.text.find(self.marker, self.sent)
            self.marker_at = at if at >= 0 else None
        if self.marker_at is not None:
            end = self.marker_at
        else:
            end = len(self.text) if final else len(self.text) - self._undecided()
        out = self.text[self.sent : end]
        self.sent = max(self.sent, end)
        return out

    def _undecided(self) -> int:
        """Length of the longest end of the text that starts a stop string or the marker."""
        watched = [*self.stops, *([self.marker] if self.marker and self.marker_at is None else [])]
        longest = 0
        for word in watched:
            for size in range(min(len(word) - 1, len(self.text)), longest, -1):
                if self.text.endswith(word[:size]):
                    longest = size
                    break
        return longest


@dataclass
class _ChoiceState:
    detokenizer: Detokenizer
    text: TextFilter
    tokens: int = 0
    finished: bool = False


def _sse(payload: msgspec.Struct) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


class ChunkWriter:
    """The ``chat.completion.chunk`` events of one response."""

    def __init__(self, request: ChatCompletionRequest, request_id: str, model: str) -> None:
        self.request = request
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        self.tool_choice = request.effective_tool_choice

    def chunk(self, choices: list[ChunkChoice], **extra: Any) -> bytes:
        return _sse(
            ChatCompletionChunk(
                id=self.request_id,
                object="chat.completion.chunk",
                created=self.created,
                model=self.model,
                system_fingerprint=None,
                choices=choices,
                **extra,
            )
        )

    def choice(
        self,
        index: int,
        delta: Delta,
        *,
        logprobs: ChoiceLogprobs | None = None,
        finish_reason: FinishReason | None = None,
        token_ids: list[int] | None = None,
        token_logprobs: list[float] | None = None,
        **extra: Any,
    ) -> bytes:
        one = ChunkChoice(
            index=index,
            delta=delta,
            logprobs=logprobs,
            finish_reason=finish_reason,
            token_ids=token_ids,
            token_logprobs=token_logprobs,
        )
        return self.chunk([one], **extra)

    def finish(self, index: int, state: _ChoiceState, reason: FinishReason) -> Iterator[bytes]:
        """What was held back, the tool calls, then the finish reason."""
        state.finished = True
        tail = state.text.tail
        content, calls = parse_tool_calls(tail, self.tool_choice) if tail else (None, [])
        rest = state.text.finish() + (content or "")
        if rest:
            yield self.choice(index, Delta(content=rest))
        if calls:
            deltas = [
                DeltaToolCall(
                    index=i,
                    id=call.id,
                    function=DeltaFunctionCall(name=call.function.name, arguments=call.function.arguments),
                )
                for i, call in enumerate(calls)
            ]
            yield self.choice(index, Delta(tool_calls=deltas))
            reason = "tool_calls" if reason == "stop" else reason
        yield self.choice(index, Delta(), finish_reason=reason)


async def sse_events(
    stream: EngineStream,
    request: ChatCompletionRequest,
    *,
    request_id: str,
    model: str,
    prompt_token_ids: list[int],
    tokenizer: Any,
    pieces: TokenPieces,
) -> AsyncIterator[bytes]:
    """The whole event stream of one request, ``data: [DONE]`` last; an engine failure after the
    first byte becomes an ``{"error": ...}`` event (OpenAI's clients raise it)."""
    out = ChunkWriter(request, request_id, model)
    marker = TOOL_CALL_START if out.tool_choice != "none" else None
    states = [
        _ChoiceState(Detokenizer(tokenizer), TextFilter(request.stop_strings, marker))
        for _ in range(request.n or 1)
    ]
    try:
        for index in range(len(states)):
            first_ids = prompt_token_ids if index == 0 else None
            yield out.choice(index, Delta(role="assistant", content=""), prompt_token_ids=first_ids)
        async for step in stream.steps():
            state = states[step.index]
            if state.finished:
                continue  # the engine went on past a stop string
            state.tokens += 1
            content = state.text.feed(state.detokenizer.add(step.token_id))
            done = step.finish_reason is not None or state.text.stopped
            if done and not state.text.stopped:
                content += state.text.feed(state.detokenizer.flush())
            logprobs = None
            if request.logprobs:
                entry = pieces.entry(step.token_id, step.logprob, step.top_logprobs)
                logprobs = ChoiceLogprobs(content=[entry])
            delta = Delta(content=content) if content else Delta()
            yield out.choice(
                step.index,
                delta,
                logprobs=logprobs,
                token_ids=[step.token_id],
                token_logprobs=finite_logprobs([step.logprob]),
            )
            if done:
                reason = "stop" if state.text.stopped else step.finish_reason
                for event in out.finish(step.index, state, reason or "stop"):
                    yield event
        for index, state in enumerate(states):
            if not state.finished:  # the engine ended without saying why
                for event in out.finish(index, state, "stop"):
                    yield event
        if request.stream_options is not None and request.stream_options.include_usage:
            completion = sum(state.tokens for state in states)
            prompt = len(prompt_token_ids)
            usage = Usage(
                prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
            )
            yield out.chunk([], usage=usage)
    except Exception as exc:
        log.error("stream failed", request_id=request_id, error=repr(exc))
        message = f"The engine failed while streaming: {exc}"
        yield _sse(ApiError(500, message, type="server_error", code="engine_error").body)
    finally:
        await stream.aclose()
    yield b"data: [DONE]\n\n"
