"""The httpx hook (and httpx2's, the fork newer OpenAI clients use): ``Client.send`` and
``AsyncClient.send`` wrapped once; outside a scope they only pass the call on."""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

from artery.capture.recording import Pending, begin, claimed

log = logging.getLogger(__name__)

MODULES = ("httpx", "httpx2")


def install() -> None:
    for name in MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if not getattr(module.AsyncClient.send, "_artery_scope", False):
            module.AsyncClient.send = _wrap_async(module, module.AsyncClient.send)
        if not getattr(module.Client.send, "_artery_scope", False):
            module.Client.send = _wrap(module, module.Client.send)


def _begin(module: Any, request: Any) -> Pending | None:
    try:
        return begin(request.method, request.url.path, request.content)
    except module.RequestNotRead:  # a streamed upload: not a model call
        return None
    except Exception:
        log.warning("capture: a request was not recorded", exc_info=True)
        return None


def _observe(module: Any, pending: Pending | None, response: Any) -> None:
    if pending is None:
        return
    try:
        if not pending.answered(response.status_code, response.headers.get("content-type", "")):
            return
        try:
            content = response.content
        except module.ResponseNotRead:
            _tee(response, pending)
            return
        pending.complete(content)
    except Exception:
        log.warning("capture: an exchange was not recorded", exc_info=True)


def _tee(response: Any, pending: Pending) -> None:
    """Keep a copy of the decoded body as the agent reads it (``read``, ``iter_lines`` and the
    clients' streams all read through ``(a)iter_bytes``), recorded once complete."""
    aiter_bytes, iter_bytes = response.aiter_bytes, response.iter_bytes
    buffer = bytearray()

    def feed(part: bytes) -> None:
        start = len(buffer)
        buffer.extend(part)
        if pending.stream_done(buffer, start):
            pending.complete(bytes(buffer))

    async def tee_aiter_bytes(chunk_size: int | None = None) -> AsyncIterator[bytes]:
        async for part in aiter_bytes(chunk_size):
            feed(part)
            yield part
        pending.complete(bytes(buffer))

    def tee_iter_bytes(chunk_size: int | None = None) -> Iterator[bytes]:
        for part in iter_bytes(chunk_size):
            feed(part)
            yield part
        pending.complete(bytes(buffer))

    response.aiter_bytes = tee_aiter_bytes
    response.iter_bytes = tee_iter_bytes


def _wrap_async(module: Any, send: Any) -> Any:
    @functools.wraps(send)
    async def wrapped(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        pending = _begin(module, request)
        with claimed(pending):
            response = await send(self, request, *args, **kwargs)
        _observe(module, pending, response)
        return response

    wrapped._artery_scope = True  # type: ignore[attr-defined]
    return wrapped


def _wrap(module: Any, send: Any) -> Any:
    @functools.wraps(send)
    def wrapped(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        pending = _begin(module, request)
        with claimed(pending):
            response = send(self, request, *args, **kwargs)
        _observe(module, pending, response)
        return response

    wrapped._artery_scope = True  # type: ignore[attr-defined]
    return wrapped
