"""OpenTelemetry set-up, and trace context carried through NATS headers (W3C traceparent).

Every process gets a real TracerProvider, so spans have ids that log lines can quote even when
nothing is exported. Export is OTLP/HTTP when ``ARTERY_OTEL_ENDPOINT`` is set.

One trace follows a rollout through every service. The pattern, the same in each:

- a message is published where the span it continues is current: ``bus.publish_event`` and
  ``bus.prepare`` put that span's ``traceparent`` into the NATS headers;
- a consumer handles each message inside ``continue_trace(tracer, "<service>.<what>",
  msg.headers)``: a CONSUMER span whose parent is the span that published the message, so
  whatever it publishes in turn (and every log line it writes) is in the same trace;
- a span that works on many earlier messages (the trainer's step, on many groups) gets *links*
  to them: their contexts travel in the ``Artery-Trace-Links`` header (``link_headers`` /
  ``extract_links``).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
from collections.abc import Iterable, Iterator, Mapping

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

_propagator = TraceContextTextMapPropagator()
_provider: TracerProvider | None = None
_owned = False  # the provider is ours (not the application's): ours to shut down
_endpoints: set[str] = set()

#: The ``service.name`` of an agent's process (the SDK), unless ``OTEL_SERVICE_NAME`` says otherwise.
SDK_SERVICE = "artery-agent"
#: Header with the traceparents of the spans a message's consumer should link to (comma-separated).
LINKS_HEADER = "Artery-Trace-Links"
#: At most this many links travel with one message.
MAX_LINKS = 256


def setup_tracing(service: str, endpoint: str | None = None, exporter: SpanExporter | None = None):
    """Install the process's TracerProvider once (or adopt one the application installed);
    later calls only add an exporter (an endpoint once)."""
    global _provider, _owned
    if _provider is None:
        current = trace.get_tracer_provider()
        if isinstance(current, TracerProvider):
            _provider, _owned = current, False
        else:
            _owned = True
            # Shut down at exit by ``shutdown_tracing``, which bounds the time it may take.
            _provider = TracerProvider(
                resource=Resource.create({"service.name": service}), shutdown_on_exit=False
            )
            trace.set_tracer_provider(_provider)
            atexit.register(shutdown_tracing)
    if exporter is None and endpoint:
        url = endpoint.rstrip("/")
        url = url if url.endswith("/v1/traces") else url + "/v1/traces"
        if url not in _endpoints:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            _endpoints.add(url)
            exporter = OTLPSpanExporter(endpoint=url)
    if exporter is not None:
        _provider.add_span_processor(BatchSpanProcessor(exporter))
    # Langfuse (LANGFUSE_PUBLIC_KEY/_SECRET_KEY/_HOST): one more exporter of the same spans.
    from artery.shared import langfuse

    langfuse_exporter = langfuse.exporter(_endpoints)
    if langfuse_exporter is not None:
        _provider.add_span_processor(BatchSpanProcessor(langfuse_exporter))
    return _provider


def setup_sdk_tracing() -> TracerProvider:
    """The agent's process: a provider unless it has one (then it is used as it is), exporting to
    ``ARTERY_OTEL_ENDPOINT`` when set. Install your own before creating a backend to use yours."""
    if _provider is not None:
        return _provider
    if isinstance(trace.get_tracer_provider(), TracerProvider):
        return setup_tracing(SDK_SERVICE)
    return setup_tracing(
        os.environ.get("OTEL_SERVICE_NAME") or SDK_SERVICE, os.environ.get("ARTERY_OTEL_ENDPOINT") or None
    )


def _bounded(work, timeout_s: float, name: str) -> bool:
    """Run ``work`` in a daemon thread, waiting up to ``timeout_s``: the SDK's flush and shutdown
    ignore their timeouts, and an unreachable endpoint must not hold up a process's exit."""
    thread = threading.Thread(target=work, name=name, daemon=True)
    thread.start()
    thread.join(timeout_s)
    return not thread.is_alive()


def flush_tracing(timeout_s: float = 5.0) -> bool:
    """Export every finished span now; whether that finished within ``timeout_s``."""
    provider = _provider
    return True if provider is None else _bounded(provider.force_flush, timeout_s, "artery-trace-flush")


def shutdown_tracing(timeout_s: float = 5.0) -> bool:
    """Export what is left, then stop: what a process does on its way out. Gives up (spans lost)
    after ``timeout_s``; whether it finished."""
    global _provider
    provider, _provider = _provider, None
    _endpoints.clear()
    if provider is None:
        return True
    work = provider.shutdown if _owned else provider.force_flush  # the application shuts its own
    return _bounded(work, timeout_s, "artery-trace-shutdown")


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def inject(headers: dict[str, str]) -> dict[str, str]:
    """Add the current span's ``traceparent`` (and ``tracestate``) to ``headers``."""
    _propagator.inject(headers)
    return headers


def extract(headers: Mapping[str, str] | None) -> otel_context.Context:
    """The context a message's headers carry; the empty context when they carry none."""
    return _propagator.extract(dict(headers or {}))


@contextlib.contextmanager
def continue_trace(
    tracer_: trace.Tracer,
    name: str,
    headers: Mapping[str, str] | None,
    *,
    kind: trace.SpanKind = trace.SpanKind.CONSUMER,
    attributes: Mapping[str, AttributeValue | None] | None = None,
    links: Iterable[trace.Link] = (),
) -> Iterator[trace.Span]:
    """A current span whose parent is the one that sent ``headers`` (a new trace without one)."""
    with tracer_.start_as_current_span(
        name,
        context=extract(headers),
        kind=kind,
        attributes={k: v for k, v in (attributes or {}).items() if v is not None},
        links=list(links),
    ) as span:
        yield span


def traceparent(span_context: trace.SpanContext) -> str:
    return f"00-{span_context.trace_id:032x}-{span_context.span_id:016x}-{int(span_context.trace_flags):02x}"


def span_context_of(value: str) -> trace.SpanContext | None:
    """The remote span context a ``traceparent`` names; None when it is not one."""
    context = _propagator.extract({"traceparent": value.strip()})
    span_context = trace.get_current_span(context).get_span_context()
    return span_context if span_context.is_valid else None


def link_headers(
    headers: dict[str, str], span_contexts: Iterable[trace.SpanContext | None]
) -> dict[str, str]:
    """Ask the consumer of a message to link its span to ``span_contexts`` (the first MAX_LINKS)."""
    values = [traceparent(c) for c in span_contexts if c is not None and c.is_valid][:MAX_LINKS]
    if values:
        headers[LINKS_HEADER] = ",".join(values)
    return headers


def extract_links(headers: Mapping[str, str] | None) -> list[trace.Link]:
    value = (headers or {}).get(LINKS_HEADER) or ""
    contexts = (span_context_of(v) for v in value.split(",")[:MAX_LINKS] if v.strip())
    return [trace.Link(c) for c in contexts if c is not None]


def current_span_context() -> trace.SpanContext | None:
    span_context = trace.get_current_span().get_span_context()
    return span_context if span_context.is_valid else None


def current_trace_id() -> str | None:
    span_context = trace.get_current_span().get_span_context()
    return format(span_context.trace_id, "032x") if span_context.is_valid else None


def current_span_id() -> str | None:
    span_context = trace.get_current_span().get_span_context()
    return format(span_context.span_id, "016x") if span_context.is_valid else None
