"""The aiohttp hook: ``ClientSession._request`` (what ``post``, ``request`` and ``async with
session.post(...)`` all call) wrapped once. The body is copied as the connection delivers it into
the response's ``StreamReader`` (whose ``feed_data`` is wrapped too), so it is recorded however
the agent reads it (``json()``, ``content.iter_any()``, line by line), even from another task."""

from __future__ import annotations

import functools
import json
import logging
from typing import Any

from artery.capture.recording import Pending, begin, claimed

log = logging.getLogger(__name__)


def install() -> None:
    try:
        import aiohttp
    except ImportError:
        return
    if not getattr(aiohttp.ClientSession._request, "_artery_scope", False):
        aiohttp.ClientSession._request = _wrap(aiohttp.ClientSession._request)  # type: ignore[method-assign]
    reader = aiohttp.StreamReader
    if not getattr(reader.feed_data, "_artery_scope", False):
        reader.feed_data = _wrap_feed_data(reader.feed_data)  # type: ignore[method-assign]
    if not getattr(reader.set_exception, "_artery_scope", False):
        reader.set_exception = _wrap_set_exception(reader.set_exception)  # type: ignore[method-assign]


#: The readers being copied, by id, with the reader itself (an id outlives no object held): a
#: ``StreamReader`` has slots, so neither a wrapper on the instance nor a weak reference to it.
#: Each leaves at its end of file, or when its connection fails.
_copies: dict[int, tuple[Any, Any]] = {}


def _wrap_feed_data(feed_data: Any) -> Any:
    @functools.wraps(feed_data)
    def wrapped(self: Any, data: bytes, *args: Any, **kwargs: Any) -> Any:
        entry = _copies.get(id(self))
        if entry is not None and entry[0] is self:
            entry[1](data)
        return feed_data(self, data, *args, **kwargs)

    wrapped._artery_scope = True  # type: ignore[attr-defined]
    return wrapped


def _wrap_set_exception(set_exception: Any) -> Any:
    """A body broken off never reaches its end of file: stop copying it (nothing is recorded)."""

    @functools.wraps(set_exception)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        entry = _copies.get(id(self))
        if entry is not None and entry[0] is self:
            del _copies[id(self)]
        return set_exception(self, *args, **kwargs)

    wrapped._artery_scope = True  # type: ignore[attr-defined]
    return wrapped


def _begin(method: str, url: Any, kwargs: dict[str, Any]) -> Pending | None:
    from yarl import URL

    try:
        body = kwargs.get("data")
        if kwargs.get("json") is not None:
            body = json.dumps(kwargs["json"])
        if not isinstance(body, (bytes, str)):
            return None
        return begin(method, URL(str(url)).path, body)
    except Exception:
        log.warning("capture: a request was not recorded", exc_info=True)
        return None


def _tee(response: Any, pending: Pending) -> None:
    reader = response.content
    # What arrived with the headers is already in the reader's buffer, unread (aiohttp keeps it
    # as a deque of bytes); what comes later goes through ``feed_data``.
    buffer = bytearray(b"".join(getattr(reader, "_buffer", ())))

    def copy(data: bytes) -> None:
        start = len(buffer)
        buffer.extend(data)
        if pending.stream_done(buffer, start):
            pending.complete(bytes(buffer))

    def at_eof() -> None:
        _copies.pop(id(reader), None)
        pending.complete(bytes(buffer))

    _copies[id(reader)] = (reader, copy)
    reader.on_eof(at_eof)


def _wrap(request: Any) -> Any:
    @functools.wraps(request)
    async def wrapped(self: Any, method: str, str_or_url: Any, *args: Any, **kwargs: Any) -> Any:
        pending = _begin(method, str_or_url, kwargs)
        with claimed(pending):
            response = await request(self, method, str_or_url, *args, **kwargs)
        if pending is not None:
            try:
                if pending.answered(response.status, response.headers.get("Content-Type", "")):
                    _tee(response, pending)
            except Exception:
                log.warning("capture: an exchange was not recorded", exc_info=True)
        return response

    wrapped._artery_scope = True  # type: ignore[attr-defined]
    return wrapped
