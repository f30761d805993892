"""The HTTP transport under ``model.openai_client()``: each request in a CLIENT span with its
``traceparent``, and the model's default body fields (ART's client proxy does the same)."""

from __future__ import annotations

import json
from typing import Any

from opentelemetry import trace

from artery.shared.tracing import inject, tracer

_tracer = tracer("artery.sdk")


def traced_transport(inner, *, body_defaults: dict[str, Any] | None = None):
    """An httpx transport that sends each request in a CLIENT span, with its ``traceparent``.

    ``body_defaults`` are added to every chat-completion request body that does not set them
    (ART's client does this for ``chat_template_kwargs``)."""
    import httpx

    class TracedTransport(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            path = request.url.path
            if body_defaults and request.method == "POST" and path.endswith("/chat/completions"):
                request = _with_body_defaults(request, body_defaults)
            name = "artery.completion" if path.endswith("completions") else f"artery.http {request.method}"
            with _tracer.start_as_current_span(
                name,
                kind=trace.SpanKind.CLIENT,
                attributes={
                    "http.request.method": request.method,
                    "url.path": path,
                    "server.address": request.url.host,
                },
            ) as span:
                request.headers.update(inject({}))
                response = await inner.handle_async_request(request)
                span.set_attribute("http.response.status_code", response.status_code)
                if response.status_code >= 500:
                    span.set_status(trace.StatusCode.ERROR)
                return response

        async def aclose(self) -> None:
            await inner.aclose()

    return TracedTransport()


def _with_body_defaults(request, defaults: dict[str, Any]):
    """The same request with ``defaults`` merged into its JSON body (keys it sets win)."""
    import httpx

    try:
        body = json.loads(request.content)
    except ValueError:
        return request  # not JSON: the server will say so
    if not isinstance(body, dict):
        return request
    body = {**defaults, **body}
    headers = [(k, v) for k, v in request.headers.multi_items() if k.lower() != "content-length"]
    return httpx.Request(request.method, request.url, headers=headers, content=json.dumps(body).encode())
