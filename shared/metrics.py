"""Prometheus metrics of every service, and the ``/metrics`` endpoint that serves them.

``shared.runtime.run_service`` starts the endpoint for every service (collector, reward,
trainer, publisher, inference, console) on ``ARTERY_<SERVICE>_METRICS_PORT`` (default 0: a free
port; ``-1``: none) at ``ARTERY_METRICS_HOST`` (default 127.0.0.1), and every log line of the
process, ``ready`` included, then carries ``metrics_url`` (``Stack`` reads it from there). The
same server answers ``/healthz`` and ``/readyz`` (``shared.health``): what compose's health
checks ask.
Message outcomes and consumer lag are counted in ``shared.consumer``, the one place where
outcomes are decided; services add their own below.
"""

from __future__ import annotations

import collections
import os
import socket
import sys
import threading
import time
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import structlog
from prometheus_client import REGISTRY, Counter, Gauge, Histogram, make_wsgi_app

from artery.shared.errors import ConfigError
from artery.shared.health import wsgi_health

# Every durable consumer (shared.consumer).
MESSAGES = Counter(
    "artery_messages", "messages settled by a durable consumer", ["service", "durable", "outcome"]
)  # outcome: acked, nacked, dead_lettered
DEAD_LETTERS = Counter("artery_dead_letters", "messages dead-lettered, by kind", ["service", "kind"])
CONSUMER_LAG = Gauge(
    "artery_consumer_lag_messages",
    "messages of the consumer's stream not yet delivered (num_pending at the last fetch)",
    ["service", "durable"],
)
# collector
INGESTED_GROUPS = Counter("artery_collector_groups", "trajectory groups stored", ["project", "model"])
INGESTED_TRAJECTORIES = Counter(
    "artery_collector_trajectories",
    "trajectories stored (rate() of it: the ingest rate)",
    ["project", "model"],
)
# reward
JUDGE_CALLS = Counter(
    "artery_reward_judge_calls", "groups sent to the judge, by outcome", ["judge_model", "outcome"]
)
JUDGE_COST = Counter("artery_reward_judge_cost_usd", "judge cost in USD (litellm's prices)", ["judge_model"])
JUDGE_TOKENS = Counter(
    "artery_reward_judge_tokens", "judge tokens, prompt and completion", ["judge_model", "kind"]
)
# trainer
STEP_SECONDS = Histogram(
    "artery_trainer_step_seconds",
    "a training step from request to recorded (pause, train, save)",
    buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
)
TRAINER_TOKENS_PER_SECOND = Gauge("artery_trainer_tokens_per_second", "tokens trained per second, last step")
TRAINER_TOKENS = Counter("artery_trainer_tokens", "tokens trained")
PAUSE_SECONDS = Histogram(
    "artery_pause_seconds",
    "time to pause inference before a step (trainer) and time spent paused (replica)",
    ["role"],
    buckets=(0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)
# inference
REPLICA_QUEUE_DEPTH = Gauge(
    "artery_inference_queue_depth",
    "chat completions the replica holds: waiting (pause gate, engine queue) or generating",
)
GENERATED_TOKENS = Counter(
    "artery_inference_generated_tokens", "completion tokens generated (rate(): tokens/s)"
)


class TokenRate:
    """Tokens per second over the last ``window_s`` seconds, read when scraped.

    ``rate(artery_inference_generated_tokens_total[1m])`` is what a Prometheus query should use;
    this gauge is for whoever reads ``/metrics`` with no Prometheus behind it (a glance, a test).
    """

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self._lock = threading.Lock()
        self._events: collections.deque[tuple[float, int]] = collections.deque()

    def add(self, tokens: int) -> None:
        now = time.monotonic()
        with self._lock:
            self._events.append((now, tokens))
            self._trim(now)

    def value(self) -> float:
        now = time.monotonic()
        with self._lock:
            self._trim(now)
            return sum(n for _, n in self._events) / self.window_s

    def _trim(self, now: float) -> None:
        while self._events and self._events[0][0] < now - self.window_s:
            self._events.popleft()


_TOKEN_RATE = TokenRate()
INFERENCE_TOKENS_PER_SECOND = Gauge(
    "artery_inference_tokens_per_second",
    f"completion tokens generated per second over the last {_TOKEN_RATE.window_s:g} s",
)
INFERENCE_TOKENS_PER_SECOND.set_function(_TOKEN_RATE.value)


def count_generated(tokens: int) -> None:
    """``tokens`` completion tokens sampled by an engine (both engines call this)."""
    if tokens > 0:
        GENERATED_TOKENS.inc(tokens)
        _TOKEN_RATE.add(tokens)


#: A scraper or probe that connects must send its request within this many seconds (a socket
#: timeout per read), and at most ``MAX_CONNECTIONS`` are served at once: each holds a thread,
#: and a slow client would otherwise hold it for ever (``ARTERY_HTTP_*`` governs the uvicorn servers).
READ_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 64


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a scrape in progress never holds the process up at exit
    request_queue_size = 128  # socketserver's 5 left connections past it waiting in the kernel

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # over the cap: closed at once, nothing read
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request, client_address) -> None:
        if isinstance(sys.exc_info()[1], TimeoutError | ConnectionError):
            return  # a client too slow, or gone: nothing to report
        super().handle_error(request, client_address)


class _Quiet(WSGIRequestHandler):
    timeout = READ_TIMEOUT_S

    def log_message(self, format, *args) -> None:
        pass  # one access line per scrape would drown the service's own log


def start_metrics_server(service: str) -> str | None:
    """Serve ``/metrics``, ``/healthz`` and ``/readyz`` in a thread of its own; return the
    ``/metrics`` URL (None when switched off)."""
    variable = f"ARTERY_{service.upper()}_METRICS_PORT"
    raw = os.environ.get(variable) or "0"
    try:
        port = int(raw)
    except ValueError:
        raise ConfigError(f"{variable}={raw!r}: a port number, 0 (a free one) or -1 (none)") from None
    if port < 0:
        return None
    host = os.environ.get("ARTERY_METRICS_HOST") or "127.0.0.1"
    server_class = _Server
    if ":" in host:  # an IPv6 address (``::`` for every interface)

        class _Server6(_Server):
            address_family = socket.AF_INET6

        server_class = _Server6
    app = wsgi_health(make_wsgi_app(REGISTRY))
    server = make_server(host, port, app, server_class=server_class, handler_class=_Quiet)
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{server.server_port}/metrics"
    structlog.contextvars.bind_contextvars(metrics_url=url)
    return url
