"""The requests hook: ``Session.send`` wrapped once (``requests.post`` goes through it). An
unstreamed response is read when ``send`` returns; a streamed one (``stream=True``) is copied as
the agent reads it through ``iter_content`` (which ``iter_lines`` and ``.content`` use)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from typing import Any

from artery.capture.recording import Pending, begin, claimed

log = logging.getLogger(__name__)


def install() -> None:
    try:
        import requests
    except ImportError:
        return
    if not getattr(requests.Session.send, "_artery_scope", False):
        requests.Session.send = _wrap(requests.Session.send)  # type: ignore[method-assign]


def _tee(response: Any, pending: Pending) -> None:
    iter_content = response.iter_content
    buffer = bytearray()

    def tee_iter_content(*args: Any, **kwargs: Any) -> Iterator[Any]:
        for part in iter_content(*args, **kwargs):
            raw = part.encode() if isinstance(part, str) else part
            start = len(buffer)
            buffer.extend(raw)
            if pending.stream_done(buffer, start):
                pending.complete(bytes(buffer))
            yield part
        pending.complete(bytes(buffer))

    response.iter_content = tee_iter_content


def _wrap(send: Any) -> Any:
    @functools.wraps(send)
    def wrapped(self: Any, request: Any, **kwargs: Any) -> Any:
        try:
            from urllib.parse import urlsplit

            pending = begin(request.method or "", urlsplit(request.url).path, request.body)
        except Exception:
            log.warning("capture: a request was not recorded", exc_info=True)
            pending = None
        with claimed(pending):
            response = send(self, request, **kwargs)
        if pending is not None:
            try:
                if pending.answered(response.status_code, response.headers.get("content-type", "")):
                    if kwargs.get("stream"):
                        _tee(response, pending)
                    else:
                        pending.complete(response.content)
            except Exception:
                log.warning("capture: an exchange was not recorded", exc_info=True)
        return response

    wrapped._artery_scope = True  # type: ignore[attr-defined]
    return wrapped
