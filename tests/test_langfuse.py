"""Langfuse: with its variables set, the spans of a rollout also go to Langfuse's OTLP endpoint
(``/api/public/otel/v1/traces``, Basic auth), from the same provider as ``ARTERY_OTEL_ENDPOINT``.

An agent process (a fresh interpreter, so the provider is its own) runs a group of rollouts; a
Langfuse stand-in and the ordinary OTLP receiver each get the same spans."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from artery.shared import langfuse
from artery.testing.otlp import OtlpReceiver, parse_export

pytestmark = pytest.mark.timeout(120)


class LangfuseReceiver:
    """Langfuse's OTLP/HTTP endpoint, as far as an exporter can tell: spans and headers recorded."""

    def __init__(self) -> None:
        self.spans: list = []
        self.requests: list[tuple[str, dict[str, str]]] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                receiver.requests.append((self.path, dict(self.headers)))
                if self.path != langfuse.OTEL_PATH:
                    self.send_error(404)
                    return
                if (
                    self.headers.get("Authorization")
                    != "Basic " + base64.b64encode(b"pk-lf-1:sk-lf-2").decode()
                ):
                    self.send_error(401)
                    return
                receiver.spans.extend(parse_export(body))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> LangfuseReceiver:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


AGENT = """
import asyncio
from opentelemetry import trace
import artery as art
from artery.shared.tracing import setup_sdk_tracing, shutdown_tracing

async def rollout(i):
    await asyncio.sleep(0.01)
    return art.Trajectory(messages_and_choices=[{"role": "user", "content": str(i)}], reward=i)

async def main():
    setup_sdk_tracing()
    with trace.get_tracer("agent").start_as_current_span("agent.episode"):
        await art.gather_trajectory_groups(
            [art.TrajectoryGroup(rollout(i) for i in range(2))], pbar_desc=None
        )

asyncio.run(main())
assert shutdown_tracing(10.0)
"""


def test_rollout_spans_reach_langfuse_with_basic_auth_and_the_otel_endpoint_too():
    with LangfuseReceiver() as lf, OtlpReceiver() as otlp:
        env = {
            **os.environ,
            "ARTERY_OTEL_ENDPOINT": otlp.endpoint,
            "LANGFUSE_HOST": lf.url + "/",
            "LANGFUSE_PUBLIC_KEY": "pk-lf-1",
            "LANGFUSE_SECRET_KEY": "sk-lf-2",
            "OTEL_SERVICE_NAME": "langfuse-agent",
        }
        run = subprocess.run(
            [sys.executable, "-c", AGENT], env=env, capture_output=True, text=True, timeout=90
        )
        assert run.returncode == 0, run.stdout + run.stderr
        deadline = time.monotonic() + 10
        while not (lf.spans and otlp.spans) and time.monotonic() < deadline:
            time.sleep(0.05)

    assert lf.requests and all(path == langfuse.OTEL_PATH for path, _ in lf.requests)
    names = sorted(s.name for s in lf.spans)
    assert names == ["agent.episode", "artery.group", "artery.rollout", "artery.rollout"], names
    assert {s.service for s in lf.spans} == {"langfuse-agent"}
    # One trace: the rollouts are children of the group, the group of the agent's episode.
    by_name = {s.name: s for s in lf.spans}
    assert len({s.trace_id for s in lf.spans}) == 1
    assert by_name["artery.group"].parent_span_id == by_name["agent.episode"].span_id
    assert {s.parent_span_id for s in lf.spans if s.name == "artery.rollout"} == {
        by_name["artery.group"].span_id
    }
    # The same spans, from the same provider, reached ARTERY_OTEL_ENDPOINT.
    assert {(s.trace_id, s.span_id) for s in otlp.spans} == {(s.trace_id, s.span_id) for s in lf.spans}


def test_langfuse_settings():
    assert langfuse.settings({}) is None
    assert langfuse.settings({"LANGFUSE_HOST": "http://lf"}) is None  # no keys: nothing sent
    assert langfuse.settings({"LANGFUSE_PUBLIC_KEY": "pk"}) is None  # half a key pair: nothing
    url, headers = langfuse.settings({"LANGFUSE_PUBLIC_KEY": "pk", "LANGFUSE_SECRET_KEY": "sk"})
    assert url == "https://cloud.langfuse.com/api/public/otel/v1/traces"
    assert headers == {"Authorization": "Basic " + base64.b64encode(b"pk:sk").decode()}
    url, _ = langfuse.settings(
        {"LANGFUSE_BASE_URL": "http://lf:3000/", "LANGFUSE_PUBLIC_KEY": "pk", "LANGFUSE_SECRET_KEY": "sk"}
    )
    assert url == "http://lf:3000/api/public/otel/v1/traces"


def test_one_langfuse_exporter_per_endpoint(monkeypatch):
    monkeypatch.setenv("LANGFUSE_HOST", "http://lf:3000")
    monkeypatch.setenv("LANGFUSE_PUBLIC_KEY", "pk")
    monkeypatch.setenv("LANGFUSE_SECRET_KEY", "sk")
    seen: set[str] = set()
    first = langfuse.exporter(seen)
    assert first is not None and seen == {"http://lf:3000/api/public/otel/v1/traces"}
    assert langfuse.exporter(seen) is None  # setup_tracing called again: not a second exporter
    first.shutdown()
