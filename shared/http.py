"""An HTTP server inside a service's event loop (uvicorn), on a port of its choosing or ours.

Every HTTP server of Artery (the inference API, the console) is served here, with limits a
stranger cannot outlast (``HttpLimits``, read from ``ARTERY_HTTP_*``):

- a client must send a request's headers within ``header_timeout_s`` of connecting (or of starting
  the next request on a kept-alive connection), and its whole body within ``body_timeout_s`` of
  the headers: past that it gets ``408`` and the connection is closed. uvicorn itself only times
  out an idle kept-alive connection, so partial headers, or a ``Content-Length`` and no body,
  held a connection (and, for a body, a request task) forever;
- at most ``max_connections`` connections are open at once; one more is answered ``503`` and
  closed at once, so connections that are slow but within their timeouts cannot pile up;
- headers are at most ``max_header_bytes`` (h11 answers ``400`` past it).

The timers watch what the client owes, not how long a request runs: a completion that generates
for minutes, or a stream that lasts, is never cut by them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Annotated

import h11
import msgspec
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from artery.shared.settings import doc, load
from artery.shared.tasks import cancel_and_wait

PREFIX = "ARTERY_HTTP_"


class HttpLimits(msgspec.Struct, kw_only=True, frozen=True):
    """Read with prefix ``ARTERY_HTTP_``; every HTTP server of every service (inference, console)."""

    header_timeout_s: Annotated[
        float,
        doc(
            "seconds a client has to send a request's headers, from connecting or its previous request", gt=0
        ),
    ] = 10.0
    body_timeout_s: Annotated[
        float, doc("seconds a client has to send a request's whole body, once its headers are in", gt=0)
    ] = 60.0
    keep_alive_s: Annotated[int, doc("seconds an idle kept-alive connection stays open", ge=1)] = 5
    max_connections: Annotated[
        int, doc("connections open at once; one more is answered 503 and closed", ge=1)
    ] = 1024
    max_header_bytes: Annotated[int, doc("largest request line and headers, in bytes", ge=1024)] = 64 * 1024


def http_limits() -> HttpLimits:
    return load(HttpLimits, PREFIX)


async def serve_http(
    app, host: str, port: int, limits: HttpLimits | None = None
) -> tuple[uvicorn.Server, asyncio.Task, int]:
    """Start ``app`` on ``host:port`` (0: a free port); return the server, its task and the port."""
    limits = limits or http_limits()
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        lifespan="off",
        http=_guarded_protocol(limits),
        timeout_keep_alive=limits.keep_alive_s,
        h11_max_incomplete_event_size=limits.max_header_bytes,
    )
    server = _Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()  # raises the reason it could not start (port taken, ...)
        await asyncio.sleep(0.02)
    return server, task, server.servers[0].sockets[0].getsockname()[1]


async def stop_http(server: uvicorn.Server, task: asyncio.Task, grace_s: float = 3.0) -> None:
    """Ask it to stop; cut what is still open (event streams never end by themselves) after ``grace_s``."""
    server.should_exit = True
    try:
        await asyncio.wait_for(asyncio.shield(task), timeout=grace_s)
    except TimeoutError:
        server.force_exit = True
        await cancel_and_wait(task)


class _Server(uvicorn.Server):
    """A server that leaves SIGTERM and SIGINT to the process's runtime (``shared.runtime``),
    which stops the service in its order (leave the registries, drain, then ``stop_http``).
    uvicorn would otherwise take both signals for itself while it serves."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _plain_response(status: int, reason: str) -> bytes:
    text = reason.encode()
    return (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: text/plain; charset=utf-8\r\n"
        f"content-length: {len(text)}\r\nconnection: close\r\n\r\n"
    ).encode() + text


_TIMED_OUT = _plain_response(408, "Request Timeout")
_TOO_MANY = _plain_response(503, "Service Unavailable")


def _guarded_protocol(limits: HttpLimits) -> type[H11Protocol]:
    class GuardedH11Protocol(H11Protocol):
        """uvicorn's h11 protocol, with a deadline on what the client owes, and a connection cap."""

        _deadline: asyncio.TimerHandle | None = None
        _owed: str | None = None  # "headers" or "body" while a deadline runs

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                transport.write(_TOO_MANY)
                transport.close()
                return
            self._expect("headers", limits.header_timeout_s)

        def connection_lost(self, exc: Exception | None) -> None:
            self._settle()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._owed is None and self.conn.their_state is h11.IDLE:
                # The first bytes of the next request on a kept-alive connection (uvicorn stops
                # its idle timer here): its headers are owed now.
                self._expect("headers", limits.header_timeout_s)
            super().data_received(data)
            self._follow()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._follow()

        def _follow(self) -> None:
            """Move the deadline along with the client's state in the request it is sending."""
            state = self.conn.their_state
            if self.transport.get_protocol() is not self:  # upgraded to a WebSocket: not ours now
                self._settle()
            elif state is h11.SEND_BODY:
                if self._owed != "body":
                    self._expect("body", limits.body_timeout_s)
            elif state is not h11.IDLE or self.transport.is_closing():
                self._settle()  # the request is in (or the connection is over): nothing owed
            # IDLE with a deadline running: headers still partial. IDLE without one: a
            # kept-alive connection at rest, which uvicorn's keep-alive timer closes.

        def _expect(self, what: str, seconds: float) -> None:
            self._settle()
            self._owed = what
            self._deadline = self.loop.call_later(seconds, self._timed_out)

        def _settle(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            self._deadline = None
            self._owed = None

        def _timed_out(self) -> None:
            self._deadline = None
            self._owed = None
            if self.transport.is_closing():
                return
            if self.cycle is None or self.cycle.response_complete or not self.cycle.response_started:
                self.transport.write(_TIMED_OUT)
            # Closing tells a request task waiting for the body that the client is gone.
            self.transport.close()

    return GuardedH11Protocol
