"""Langfuse: the process's spans also go to Langfuse's OpenTelemetry endpoint.

Langfuse ingests OTLP/HTTP traces at ``{host}/api/public/otel/v1/traces`` with Basic auth
(public key : secret key). With ``LANGFUSE_PUBLIC_KEY`` and ``LANGFUSE_SECRET_KEY`` set (and
``LANGFUSE_HOST``, or ``LANGFUSE_BASE_URL``, else Langfuse Cloud), ``artery.shared.tracing`` adds
one more OTLP exporter to the same TracerProvider that exports to ``ARTERY_OTEL_ENDPOINT``: the
same spans (``artery.group`` → ``artery.rollout`` → ``artery.completion`` → the services') reach
both, with the same trace ids; there is no second tracing path. Every process that has the
variables exports: the agent's, and the services' when their environment carries them.
"""

from __future__ import annotations

import base64
import logging
import os
from collections.abc import Mapping

from opentelemetry.sdk.trace.export import SpanExporter

__all__ = ["DEFAULT_HOST", "OTEL_PATH", "exporter", "settings"]

log = logging.getLogger(__name__)

#: Langfuse Cloud, the Langfuse SDK's own default host.
DEFAULT_HOST = "https://cloud.langfuse.com"
#: Where a Langfuse host takes OTLP/HTTP traces.
OTEL_PATH = "/api/public/otel/v1/traces"


def settings(env: Mapping[str, str] | None = None) -> tuple[str, dict[str, str]] | None:
    """The endpoint and headers Langfuse's variables ask for; ``None`` when they are not set.
    A key without the other is a mistake: said once, and nothing is sent."""
    env = os.environ if env is None else env
    public, secret = env.get("LANGFUSE_PUBLIC_KEY") or "", env.get("LANGFUSE_SECRET_KEY") or ""
    host = env.get("LANGFUSE_HOST") or env.get("LANGFUSE_BASE_URL") or ""
    if not (public or secret):
        if host:
            log.warning("LANGFUSE_HOST is set without LANGFUSE_PUBLIC_KEY/LANGFUSE_SECRET_KEY: no export")
        return None
    if not (public and secret):
        log.warning("Langfuse needs both LANGFUSE_PUBLIC_KEY and LANGFUSE_SECRET_KEY: no export")
        return None
    token = base64.b64encode(f"{public}:{secret}".encode()).decode()
    return (host or DEFAULT_HOST).rstrip("/") + OTEL_PATH, {"Authorization": f"Basic {token}"}


def exporter(seen: set[str]) -> SpanExporter | None:
    """An OTLP/HTTP exporter to Langfuse, unless it is not configured or its URL is in ``seen``
    (the endpoints this process already exports to; the URL is added)."""
    found = settings()
    if found is None or found[0] in seen:
        return None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    url, headers = found
    seen.add(url)
    return OTLPSpanExporter(endpoint=url, headers=headers)
