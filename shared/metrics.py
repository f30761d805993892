"""Prometheus metrics of every service, and the ``/metrics`` endpoint that serves them.

``shared.runtime.run_service`` starts the endpoint for every service (collector, reward,
trainer, publisher, inference, console) on ``ARTERY_<SERVICE>_METRICS_PORT`` (default 0: a free
port; ``-1``: none) at ``ARTERY_METRICS_HOST`` (default 127.0.0.1), and every log line of the
process, ``ready`` included, then carries ``metrics_url`` (``Stack`` reads it from there).
Message outcomes and consumer lag are counted in ``shared.consumer``, the one place where
outcomes are decided; services add their own below.
"""

from __future__ import annotations

import os

import structlog
from prometheus_client import Counter, Gauge, Histogram, start_http_server

from artery.shared.errors import ConfigError

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
REPLICA_QUEUE_DEPTH = Gauge("artery_inference_queue_depth", "requests admitted and not finished")
GENERATED_TOKENS = Counter(
    "artery_inference_generated_tokens", "completion tokens generated (rate(): tokens/s)"
)


def start_metrics_server(service: str) -> str | None:
    """Serve ``/metrics`` in a thread of its own; return its URL (None when switched off)."""
    variable = f"ARTERY_{service.upper()}_METRICS_PORT"
    raw = os.environ.get(variable) or "0"
    try:
        port = int(raw)
    except ValueError:
        raise ConfigError(f"{variable}={raw!r}: a port number, 0 (a free one) or -1 (none)") from None
    if port < 0:
        return None
    host = os.environ.get("ARTERY_METRICS_HOST") or "127.0.0.1"
    server, _ = start_http_server(port, addr=host)
    url = f"http://{host}:{server.server_port}/metrics"
    structlog.contextvars.bind_contextvars(metrics_url=url)
    return url
