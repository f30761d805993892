"""An OTLP/HTTP trace receiver that records spans: the stand-in for the OpenTelemetry collector
and Jaeger where no image registry is reachable (compose.standins.yaml, `make compose-test`).

POST /v1/traces   OTLP/HTTP, protobuf or JSON (gzip or not), as every Artery service sends it
GET  /spans       the spans received, as JSON: [{trace_id, span_id, parent_span_id, name,
                  service, kind, start_ns}], newest last; ?trace_id=HEX keeps one trace
GET  /healthz     200 once listening

Spans are kept in memory (the newest MAX_SPANS); they are gone when the container restarts, as
they are from Jaeger's in-memory store. Arguments meant for the collector (``--config=...``,
which compose.yaml passes) are ignored.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

MAX_SPANS = 200_000
_spans: collections.deque[dict] = collections.deque(maxlen=MAX_SPANS)
_lock = threading.Lock()


def record(request: ExportTraceServiceRequest) -> int:
    count = 0
    with _lock:
        for resource_spans in request.resource_spans:
            attributes = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            service = attributes.get("service.name", "")
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    _spans.append(
                        {
                            "trace_id": span.trace_id.hex(),
                            "span_id": span.span_id.hex(),
                            "parent_span_id": span.parent_span_id.hex(),
                            "name": span.name,
                            "service": service,
                            "kind": span.kind,
                            "start_ns": span.start_time_unix_nano,
                        }
                    )
                    count += 1
    return count


class Handler(BaseHTTPRequestHandler):
    def _reply(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        if urlsplit(self.path).path != "/v1/traces":
            return self._reply(404, b"only /v1/traces\n", "text/plain")
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        content_type = (self.headers.get("Content-Type") or "").split(";")[0].strip()
        request = ExportTraceServiceRequest()
        try:
            if content_type == "application/json":
                json_format.Parse(body, request)
            else:
                request.ParseFromString(body)
        except Exception as exc:  # malformed input: the client's error, answered as OTLP does
            return self._reply(400, f"cannot decode: {exc}\n".encode(), "text/plain")
        record(request)
        response = ExportTraceServiceResponse()
        if content_type == "application/json":
            self._reply(200, json_format.MessageToJson(response).encode(), "application/json")
        else:
            self._reply(200, response.SerializeToString(), "application/x-protobuf")

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        if url.path == "/healthz":
            return self._reply(200, b"ok\n", "text/plain")
        if url.path != "/spans":
            return self._reply(404, b"/spans, /healthz, POST /v1/traces\n", "text/plain")
        wanted = parse_qs(url.query).get("trace_id")
        with _lock:
            spans = [s for s in _spans if not wanted or s["trace_id"] in wanted]
        self._reply(200, json.dumps(spans).encode(), "application/json")

    def log_message(self, format: str, *args) -> None:
        pass  # one line per export would drown the container's log


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=4318)
    args, ignored = parser.parse_known_args()
    server = ThreadingHTTPServer(("0.0.0.0", args.port), Handler)
    print(f"otlp-recorder: listening on :{args.port}; ignoring {ignored}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
