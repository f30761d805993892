"""From a request the hooks saw to an exchange in the scope's trajectory, whatever the HTTP
client: ``begin`` decides whether the call is recorded, ``Pending.complete`` records it once its
body has been read. Nothing here may fail the agent's call: what cannot be read is left out."""

from __future__ import annotations

import contextvars
import datetime as dt
import json
import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from artery.capture import scope
from artery.capture.exchanges import Exchange, Kind, kind_of, native_response
from artery.capture.streams import reassemble

log = logging.getLogger(__name__)

#: Where a stream that ends with ``[DONE]`` (chat and completions) is complete: the OpenAI client
#: stops reading there, so waiting for the connection's end would never record it.
SSE_DONE = re.compile(rb"(?:^|\n)data: ?\[DONE\]")


#: Set while a hook's call is in flight: a client built on another (httpx over an aiohttp
#: transport, as the OpenAI client's ``DefaultAioHttpClient``) is recorded once, by the outer hook.
_claimed: contextvars.ContextVar[bool] = contextvars.ContextVar("artery_capture_claimed", default=False)


@contextmanager
def claimed(pending: Pending | None) -> Iterator[None]:
    """Around the wrapped call: the HTTP clients it goes through record nothing more."""
    if pending is None:
        yield
        return
    token = _claimed.set(True)
    try:
        yield
    finally:
        _claimed.reset(token)


class Pending:
    """A recorded call whose response has not been read yet."""

    def __init__(self, recorder: scope.Recorder, kind: Kind, request: dict[str, Any]) -> None:
        self.recorder = recorder
        self.kind = kind
        self.request = request
        self.start_time = dt.datetime.now(dt.UTC)
        self.streamed = bool(request.get("stream"))
        self._done = False

    def answered(self, status: int, content_type: str) -> bool:
        """Whether the response is worth reading: a success; a stream when the server says so."""
        self.streamed = self.streamed or content_type.startswith("text/event-stream")
        return 200 <= status < 300

    def stream_done(self, buffer: bytes | bytearray, start: int) -> bool:
        return self.streamed and SSE_DONE.search(buffer, max(0, start - 16)) is not None

    def complete(self, content: bytes) -> None:
        """Record the exchange (once), from the whole response body."""
        if self._done:
            return
        self._done = True
        try:
            data = reassemble(self.kind, content) if self.streamed else json.loads(content)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            log.debug("capture: a %s response could not be read: %s", self.kind, exc)
            return
        if not isinstance(data, dict):
            return
        served = data.get("model")
        exchange = Exchange(
            request=self.request,
            response=native_response(self.kind, data),
            model=served if isinstance(served, str) else None,
            start_time=self.start_time,
            end_time=dt.datetime.now(dt.UTC),
        )
        try:
            self.recorder.record_exchange(self.kind, exchange)
        except Exception:  # the agent is reading its response: never fail that
            log.warning("capture: an exchange was not recorded", exc_info=True)


def begin(method: str, path: str, body: bytes | str | None) -> Pending | None:
    """A ``Pending`` when a scope is open here and this call is one of the recorded APIs."""
    recorder = scope.current_recorder()
    if recorder is None or _claimed.get():
        return None
    kind = kind_of(method, path)
    if kind is None or body is None:
        return None
    try:
        request = json.loads(body)
    except ValueError:
        return None
    if not isinstance(request, dict):
        return None
    return Pending(recorder, kind, request)
