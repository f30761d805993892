"""A tiny OTLP/HTTP trace receiver for tests: ``POST /v1/traces`` (protobuf) in, spans recorded.

Point ``ARTERY_OTEL_ENDPOINT`` at ``receiver.endpoint`` and every process exports its spans here
through the real OTLP exporter; the test then reads ``receiver.spans``.
"""

from __future__ import annotations

import gzip
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str | None
    kind: int
    links: tuple[tuple[str, str], ...] = ()
    attributes: dict = field(default_factory=dict, hash=False, compare=False)


def _value(any_value):
    kind = any_value.WhichOneof("value")
    return None if kind is None else getattr(any_value, kind)


def parse_export(body: bytes) -> list[ReceivedSpan]:
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    spans = []
    for resource_spans in request.resource_spans:
        resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
        service = str(resource.get("service.name", ""))
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(
                    ReceivedSpan(
                        service=service,
                        name=span.name,
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex() or None,
                        kind=span.kind,
                        links=tuple((link.trace_id.hex(), link.span_id.hex()) for link in span.links),
                        attributes={a.key: _value(a.value) for a in span.attributes},
                    )
                )
    return spans


class OtlpReceiver:
    """``with OtlpReceiver() as receiver:`` a server on a free local port, in a thread."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        self.spans: list[ReceivedSpan] = []
        self.requests = 0
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                encoding = (self.headers.get("Content-Encoding") or "").lower()
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                if self.path.rstrip("/") != "/v1/traces":
                    self.send_error(404)
                    return
                try:
                    spans = parse_export(body)
                except Exception:
                    self.send_error(400, "not an ExportTraceServiceRequest")
                    return
                with receiver._lock:
                    receiver.spans.extend(spans)
                    receiver.requests += 1
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):  # quiet
                pass

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        # An AF_INET server's host is a str (typeshed allows bytes, for other families).
        return f"http://{host.decode() if isinstance(host, bytes) else host}:{port}"

    def start(self) -> OtlpReceiver:
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-receiver", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> OtlpReceiver:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def snapshot(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self.spans)

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        return [s for s in self.snapshot() if s.trace_id == trace_id]

    def wait_for(self, predicate: Callable[[list[ReceivedSpan]], bool], timeout_s: float = 30.0) -> bool:
        """Poll until ``predicate(spans)`` holds; whether it did within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate(self.snapshot()):
                return True
            time.sleep(0.05)
        return predicate(self.snapshot())
