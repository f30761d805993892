"""OpenTelemetry set-up, and trace context carried through NATS headers (W3C traceparent).

Every process gets a real TracerProvider, so spans have ids that log lines can quote even when
nothing is exported. Export is OTLP/HTTP when ``ARTERY_OTEL_ENDPOINT`` is set and the exporter
package is installed.
"""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_propagator = TraceContextTextMapPropagator()
_configured = False


def setup_tracing(service: str, endpoint: str | None = None, exporter: SpanExporter | None = None):
    """Install the process's TracerProvider once; later calls only add an exporter."""
    global _configured
    if not _configured:
        trace.set_tracer_provider(TracerProvider(resource=Resource.create({"service.name": service})))
        _configured = True
    provider = trace.get_tracer_provider()
    if exporter is None and endpoint:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:  # the exporter is an optional extra; tracing still runs locally
            OTLPSpanExporter = None
        if OTLPSpanExporter is not None:
            exporter = OTLPSpanExporter(endpoint=endpoint.rstrip("/") + "/v1/traces")
    if exporter is not None:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def inject(headers: dict[str, str]) -> dict[str, str]:
    """Add the current span's ``traceparent`` (and ``tracestate``) to ``headers``."""
    _propagator.inject(headers)
    return headers


def extract(headers: Mapping[str, str] | None) -> otel_context.Context:
    """The context a message's headers carry; the empty context when they carry none."""
    return _propagator.extract(dict(headers or {}))


def current_trace_id() -> str | None:
    span_context = trace.get_current_span().get_span_context()
    return format(span_context.trace_id, "032x") if span_context.is_valid else None
