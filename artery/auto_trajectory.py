"""ART's ``auto_trajectory`` / ``capture_auto_trajectory``: a rollout's chat completions, recorded.

Deprecated, as in ART: ``art.trajectory(coro)`` and ``art.current_trajectory()`` (``artery.capture``)
record every wire API as exchanges. These keep doing what they did, with one ``DeprecationWarning``.

``await capture_auto_trajectory(agent(...))`` runs the coroutine in a context where every chat
completion it makes over HTTP (the OpenAI client, litellm, plain ``httpx``; ``httpx2`` as well,
the fork newer OpenAI clients use) is recorded into a ``Trajectory``, which it returns; inside,
``auto_trajectory()`` is that trajectory, so the agent can set its reward, metrics and metadata.

How a call is recorded:

- A ``POST`` to a path ending in ``/chat/completions`` answered 200: the request's ``messages``
  and ``tools`` (its JSON body) and the response's first choice. The choice becomes an OpenAI
  ``Choice`` (a dict when ``openai`` is not installed) and goes through ``artery.convert`` like
  any choice the agent appends itself: Artery's ``token_ids`` and ``token_logprobs`` (sent whether
  or not the agent asked for ``logprobs``) make its sample, so training uses exactly what was sampled.
- A call whose messages continue a conversation already recorded (the same messages first, the
  recorded choices standing for the assistant messages the agent sent back, and the same tools)
  extends it; any other call starts another one. When the coroutine ends, the longest
  conversation is the trajectory's ``messages_and_choices``; the others are its
  ``additional_histories``.
- Streamed completions (``stream=True``, server-sent events) are put back together (content,
  tool calls, logprobs, token ids) once the agent has read the stream to its end; a stream left
  unread or broken off is not recorded.
- The served model's ``<name>@<step>`` sets ``initial_policy_version`` (first call) and
  ``final_policy_version`` (last call).

``httpx``'s ``Client.send`` and ``AsyncClient.send`` are wrapped once, on the first capture;
outside a capture the wrappers only pass the call on, and nothing a capture does can make a
request fail (a response it cannot read is left out). Only the first choice of each call is
recorded (``n > 1`` records one).
"""

from __future__ import annotations

import contextvars
import functools
import importlib
import json
import logging
import threading
import warnings
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any, Literal, overload

import msgspec

from artery import convert
from artery.capture import api
from artery.completion_bodies import SSE_DONE, as_choice, choice_from_json, choice_from_sse
from artery.shared.served_name import parse_served_name
from artery.trajectories import History, Trajectory

__all__ = ["auto_trajectory", "capture_auto_trajectory"]

log = logging.getLogger(__name__)

#: The HTTP clients whose ``send`` a capture wraps, when installed.
_HTTP_MODULES = ("httpx", "httpx2")


@overload
def auto_trajectory(*, required: Literal[True]) -> Trajectory: ...


@overload
def auto_trajectory(*, required: Literal[False] = False) -> Trajectory | None: ...


def auto_trajectory(*, required: bool = False) -> Trajectory | None:
    """The trajectory being captured around this call; ``None`` outside a capture, or a
    ``RuntimeError`` when ``required``."""
    _deprecated("auto_trajectory", "art.current_trajectory()")
    context = _context.get()
    if context is None:
        scoped = api.current_trajectory()  # inside ``art.trajectory(...)``: that one
        if scoped is not None:
            return scoped
        if required:
            raise RuntimeError(
                "No auto trajectory in context. `auto_trajectory(required=True)` must be called "
                "in a `capture_auto_trajectory(...)` scope."
            )
        return None
    return context.trajectory


async def capture_auto_trajectory(coroutine: Coroutine[Any, Any, Any]) -> Trajectory:
    """Run ``coroutine`` and return the trajectory of the chat completions it made."""
    _deprecated("capture_auto_trajectory", "art.trajectory(coroutine)")
    _install()
    context = _Capture()
    token = _context.set(context)
    try:
        await coroutine
    finally:
        _context.reset(token)
        context.close()
    return context.trajectory


_warned: set[str] = set()


def _deprecated(name: str, instead: str) -> None:
    if name not in _warned:
        _warned.add(name)
        warnings.warn(f"`{name}` is deprecated: use `{instead}`", DeprecationWarning, stacklevel=3)


class _Capture:
    """One capture: its trajectory, filled in by the wrapped ``send``s (from tasks and threads)."""

    def __init__(self) -> None:
        self.trajectory = Trajectory()
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            _promote_longest(self.trajectory)
        self.trajectory.finish()

    def observe(self, module: Any, request: Any, response: Any) -> None:
        """Record ``response`` if it answers a chat completion: now when it has been read, else
        once its body has been read to the end."""
        if request.method != "POST" or not request.url.path.endswith("/chat/completions"):
            return
        if response.status_code != 200:
            return
        try:
            body = json.loads(request.content)
        except (module.RequestNotRead, ValueError):  # a streamed upload, or not JSON
            return
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            return
        streamed = bool(body.get("stream")) or response.headers.get("content-type", "").startswith(
            "text/event-stream"
        )
        try:
            content = response.content
        except module.ResponseNotRead:
            _tee_body(
                response, streamed, lambda content: self.record_safely(body, content, streamed=streamed)
            )
            return
        self.record(body, content, streamed=streamed)

    def record_safely(self, body: dict[str, Any], content: bytes, *, streamed: bool) -> None:
        try:
            self.record(body, content, streamed=streamed)
        except Exception:  # the agent is reading its stream: never fail that
            log.warning("auto_trajectory: a chat completion was not recorded", exc_info=True)

    def record(self, body: dict[str, Any], content: bytes, *, streamed: bool) -> None:
        try:
            parsed = choice_from_sse(content) if streamed else choice_from_json(content)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            log.debug("auto_trajectory: a chat completion's response could not be read: %s", exc)
            return
        if parsed is None:
            return
        data, served = parsed
        choice = as_choice(data)
        try:
            convert.to_message(choice)  # what publish() will do: refuse it now rather than then
        except (ValueError, msgspec.ValidationError) as exc:
            log.debug("auto_trajectory: a choice is not a chat message: %s", exc)
            return
        messages, tools = body["messages"], body.get("tools")
        with self._lock:
            history = _history_for(self.trajectory, messages, tools)
            history.messages_and_choices.extend(messages[len(history.messages_and_choices) :])
            history.messages_and_choices.append(choice)
            history.tools = tools
            policy = parse_served_name(served or "")  # ``<model>@<step>``
            if policy is not None:
                if self.trajectory.initial_policy_version is None:
                    self.trajectory.initial_policy_version = policy[1]
                self.trajectory.final_policy_version = policy[1]


_context: contextvars.ContextVar[_Capture | None] = contextvars.ContextVar(
    "artery_auto_trajectory", default=None
)


# --------------------------------------------------------------------------- conversations


def _history_for(trajectory: Trajectory, messages: list[Any], tools: Any) -> Trajectory | History:
    """The conversation this call continues (as ART picks it), or a new additional history."""
    candidates: list[Trajectory | History] = [trajectory, *trajectory.additional_histories]
    for candidate in candidates:
        if _continues(candidate, messages, tools):
            return candidate
    history = History(messages_and_choices=[])
    trajectory.additional_histories.append(history)
    return history


def _continues(history: Trajectory | History, messages: list[Any], tools: Any) -> bool:
    recorded = history.messages_and_choices
    if len(recorded) > len(messages):
        return False
    if not (history.tools == tools or (not recorded and history.tools is None)):
        return False
    return all(_key(a) == _key(b) for a, b in zip(recorded, messages, strict=False))


def _key(item: Any) -> Any:
    """A message as compared between calls: a recorded choice equals the assistant message the
    agent sent back, whatever fields its client added (``refusal``, ``annotations``...)."""
    try:
        message = convert.to_message(item)
    except (ValueError, msgspec.ValidationError):
        return item
    data = msgspec.to_builtins(message)
    data.pop("sample", None)
    data.pop("trainable", None)
    if data.get("role") == "assistant" and data.get("content") is None:
        data["content"] = ""
    for call in data.get("tool_calls") or []:
        # Clients re-serialise arguments (LangChain does): the same JSON with other spacing or
        # key order is the same call, or the turn's recorded sample would be lost.
        function = call.get("function") or {}
        try:
            function["arguments"] = json.loads(function.get("arguments") or "null")
        except (TypeError, ValueError):
            pass
    return data


def _promote_longest(trajectory: Trajectory) -> None:
    """The longest conversation becomes the trajectory's own; the first one wins a tie."""
    histories = trajectory.additional_histories
    if not histories:
        return
    longest = max(histories, key=lambda h: len(h.messages_and_choices))
    if len(longest.messages_and_choices) <= len(trajectory.messages_and_choices):
        return
    trajectory.messages_and_choices, longest.messages_and_choices = (
        longest.messages_and_choices,
        trajectory.messages_and_choices,
    )
    trajectory.tools, longest.tools = longest.tools, trajectory.tools


# --------------------------------------------------------------------------- httpx


def _tee_body(response: Any, streamed: bool, on_complete: Callable[[bytes], None]) -> None:
    """Keep a copy of the decoded body as the agent reads it (``aread``, ``aiter_lines`` and the
    OpenAI client's stream all read through ``aiter_bytes``) and hand it over once complete: at
    the end, or for a stream at its ``[DONE]`` (after which the OpenAI client stops reading)."""
    aiter_bytes, iter_bytes = response.aiter_bytes, response.iter_bytes
    buffer = bytearray()
    handed = False

    def hand_over() -> None:
        nonlocal handed
        if not handed:
            handed = True
            on_complete(bytes(buffer))

    def feed(part: bytes) -> None:
        start = max(0, len(buffer) - 16)
        buffer.extend(part)
        if streamed and SSE_DONE.search(buffer, start):
            hand_over()

    async def tee_aiter_bytes(chunk_size: int | None = None) -> AsyncIterator[bytes]:
        async for part in aiter_bytes(chunk_size):
            feed(part)
            yield part
        hand_over()

    def tee_iter_bytes(chunk_size: int | None = None) -> Iterator[bytes]:
        for part in iter_bytes(chunk_size):
            feed(part)
            yield part
        hand_over()

    response.aiter_bytes = tee_aiter_bytes
    response.iter_bytes = tee_iter_bytes


_install_lock = threading.Lock()


def _install() -> None:
    """Wrap ``send`` of the HTTP clients that are installed (once per process)."""
    with _install_lock:
        for name in _HTTP_MODULES:
            try:
                module = importlib.import_module(name)
            except ImportError:
                continue
            if not getattr(module.AsyncClient.send, "_artery_capture", False):
                module.AsyncClient.send = _wrap_async_send(module, module.AsyncClient.send)
            if not getattr(module.Client.send, "_artery_capture", False):
                module.Client.send = _wrap_send(module, module.Client.send)


def _observe(module: Any, request: Any, response: Any) -> None:
    context = _context.get()
    if context is None:
        return
    try:
        context.observe(module, request, response)
    except Exception:  # recording must never fail the agent's request
        log.warning("auto_trajectory: a chat completion was not recorded", exc_info=True)


def _wrap_async_send(module: Any, send: Any) -> Any:
    @functools.wraps(send)
    async def wrapped(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        response = await send(self, request, *args, **kwargs)
        _observe(module, request, response)
        return response

    wrapped._artery_capture = True  # type: ignore[attr-defined]
    return wrapped


def _wrap_send(module: Any, send: Any) -> Any:
    @functools.wraps(send)
    def wrapped(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        response = send(self, request, *args, **kwargs)
        _observe(module, request, response)
        return response

    wrapped._artery_capture = True  # type: ignore[attr-defined]
    return wrapped
