"""The OpenAI-compatible HTTP API of the inference service, over any ``Engine``.

``POST /v1/chat/completions`` (plain or streamed; beside it, on the same engine path, the legacy
``/v1/completions``, OpenAI's ``/v1/responses`` and Anthropic's ``/v1/messages``: see ``wire``),
``GET /v1/models``, ``GET /health`` (serving state: paused, lagging), ``GET /healthz`` and
``GET /readyz`` (``shared.health``). With an API key set, ``/v1`` needs it (as a bearer token, or
in Anthropic's ``x-api-key`` header), and ``/health`` answers a probe without it by its code and
``status`` alone: which adapters are served, and how far behind, is told to key holders only. Bodies are
decoded and encoded with msgspec; every error has OpenAI's shape, ``{"error": {message, type, param,
code}}``, with the status OpenAI would use (400, 401, 404, 413) plus 503 ``engine_paused`` when the
pause gate gave up waiting, and 500 ``engine_error`` when the engine failed.

A body larger than ``max_body_bytes`` is a 413 before it is read: at once when its
``Content-Length`` says so, else as soon as the bytes received pass the limit (a chunked body).

Metrics: ``artery_inference_queue_depth`` counts the completions held (from arrival until the last
byte, streamed or not; waiting at the pause gate included); the engines count generated tokens.

A completion runs in an ``inference.chat_completion`` span (SERVER) that continues the caller's
``traceparent`` header (the SDK's ``openai_client()`` sends it), until the last streamed chunk.
"""

from __future__ import annotations

import secrets
import time
import uuid

import msgspec
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from opentelemetry import trace
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from artery.services.inference import completions, messages, responses
from artery.services.inference.chat import (
    TokenPieces,
    build_choice,
    check_logit_bias,
    decode_request,
    render_prompt,
    sampling_params,
)
from artery.services.inference.engine.base import GenerationRequest, UnknownAdapter
from artery.services.inference.openai_types import (
    ApiError,
    ChatCompletion,
    ChatCompletionRequest,
    ModelCard,
    ModelList,
    Usage,
    check_request,
)
from artery.services.inference.serving import Resolved, ServingState
from artery.services.inference.settings import DEFAULT_MAX_BODY_BYTES
from artery.services.inference.streaming import EngineStream, sse_events
from artery.services.inference.wire import traced
from artery.services.inference.wire import translate_errors as _translate_errors
from artery.shared.health import HEALTH
from artery.shared.logs import get_logger

log = get_logger(__name__)


def create_app(state: ServingState, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    app = FastAPI(title="Artery inference", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serving = state
    started = int(time.time())
    pieces_of: dict[int, TokenPieces] = {}

    def pieces(tokenizer: object) -> TokenPieces:
        # Built on first use: an engine has its tokenizer only once started.
        found = pieces_of.get(id(tokenizer))
        if found is None:
            pieces_of.clear()
            found = pieces_of[id(tokenizer)] = TokenPieces(tokenizer)
        return found

    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(ClientDisconnect, _client_gone)
    app.add_exception_handler(Exception, _unexpected_error)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(_authorize)])

    @app.get("/health")
    async def health(http: Request) -> Response:
        detailed = _has_key(http)
        lag = state.checkpoint_lag()
        if lag is not None:  # unhealthy: behind training for longer than it may be
            details = {
                "newest_step": lag.newest_step,
                "served_step": lag.served_step,
                "behind_s": round(lag.behind_s, 3),
                "adapters": state.engine.adapters(),
            }
            return _json({"status": "lagging", **(details if detailed else {})}, status=503)
        status = "paused" if state.is_paused() else "ok"
        return _json({"status": status, **({"adapters": state.engine.adapters()} if detailed else {})})

    @app.get("/healthz")
    async def healthz() -> Response:
        return _json({"status": "ok"})

    @app.get("/readyz")
    async def readyz() -> Response:
        # Ready from the replica's ``ready`` line until it is asked to stop; a pause is not
        # unreadiness (requests wait at the gate), but it is said.
        status, body = HEALTH.status()
        return _json({**body, "paused": state.is_paused()}, status=status)

    @v1.get("/models")
    async def models() -> Response:
        cards = [
            ModelCard(id=name, created=started, max_model_len=state.engine.max_context)
            for name in state.served()
        ]
        return _json(ModelList(data=cards))

    @v1.post("/chat/completions")
    async def chat_completions(http: Request) -> Response:
        return await traced(http, "inference.chat_completion", lambda span: _chat_completion(http, span))

    async def _chat_completion(http: Request, span: trace.Span) -> Response:
        request = decode_request(await http.body())
        span.set_attribute("artery.requested_model", request.model)
        check_request(request)
        with _translate_errors():
            state.resolve(request.model)  # an unknown name fails now, not after waiting out a pause
        engine = state.engine
        check_logit_bias(request, engine.tokenizer)
        prompt = render_prompt(engine.tokenizer, request, engine.max_context)
        params = sampling_params(request, len(prompt), engine.max_context, state.default_max_tokens)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"

        def prepare() -> tuple[Resolved, GenerationRequest]:
            # Resolved once admitted: a request held by a pause gets the adapter loaded during it.
            resolved = state.resolve(request.model)
            generation = GenerationRequest(
                prompt_token_ids=prompt, params=params, adapter=resolved.adapter, request_id=request_id
            )
            return resolved, generation

        if request.stream:
            stream = EngineStream(engine, state.admit, prepare)
            with _translate_errors():
                resolved = await stream.start()
            span.set_attribute("artery.served_name", resolved.served_name)
            events = sse_events(
                stream,
                request,
                request_id=request_id,
                model=resolved.served_name,
                prompt_token_ids=prompt,
                tokenizer=engine.tokenizer,
                pieces=pieces(engine.tokenizer),
            )
            return StreamingResponse(
                events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )

        async def generate() -> tuple[Resolved, list]:
            async with state.admit():
                resolved, generation = prepare()
                span.set_attribute("artery.served_name", resolved.served_name)
                return resolved, await engine.generate(generation)

        with _translate_errors():
            try:
                resolved, completions = await generate()
            except UnknownAdapter:
                # The bare name means "the newest step": the step it resolved to was retired while
                # the request waited (retention, with training going on beside serving). Once more,
                # with what is newest now; a request for a retired ``<model>@<step>`` stays a 404.
                if request.model != state.model:
                    raise
                resolved, completions = await generate()
        return _json(
            _completion(request, request_id, resolved, prompt, completions, pieces(engine.tokenizer))
        )

    # The other wire APIs, on the same engine path (``wire``): raw prompts, OpenAI's Responses
    # API, Anthropic's Messages API.
    @v1.post("/completions")
    async def legacy_completions(http: Request) -> Response:
        return await completions.handle(http, state, pieces(state.engine.tokenizer))

    @v1.post("/messages")
    async def anthropic_messages(http: Request) -> Response:
        return await messages.handle(http, state)

    @v1.post("/responses")
    async def openai_responses(http: Request) -> Response:
        return await responses.handle(http, state)

    app.include_router(v1)
    return app


class BodyLimit:
    """Refuses a request body over ``max_bytes`` with 413, without reading (or keeping) it.

    A declared ``Content-Length`` over the limit is answered before the app runs; otherwise the
    bytes are counted as the app reads them, and the read that passes the limit raises the 413.
    The server discards whatever of the body is still to come.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if (_content_length(scope) or 0) > self.max_bytes:
            error = self._too_large()
            await _json(error.body, error.status)(scope, receive, send)
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise self._too_large()
            return message

        await self.app(scope, counted, send)

    def _too_large(self) -> ApiError:
        return ApiError(
            413,
            f"The request body is larger than the limit of {self.max_bytes} bytes.",
            code="request_too_large",
        )


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:  # the server refuses a malformed one before we see it
                return None
    return None


def _completion(
    request: ChatCompletionRequest,
    request_id: str,
    resolved: Resolved,
    prompt: list[int],
    completions: list,
    pieces: TokenPieces,
) -> ChatCompletion:
    choices = [
        msgspec.structs.replace(build_choice(c, request, pieces), served_model=resolved.served_name)
        for c in sorted(completions, key=lambda c: c.index)
    ]
    generated = sum(len(choice.token_ids) for choice in choices)
    return ChatCompletion(
        id=request_id,
        created=int(time.time()),
        model=resolved.served_name,
        choices=choices,
        usage=Usage(
            prompt_tokens=len(prompt), completion_tokens=generated, total_tokens=len(prompt) + generated
        ),
        prompt_token_ids=prompt,
    )


def _has_key(http: Request) -> bool:
    """Whether the request may see more than a probe: no key is set, or it carries the key."""
    try:
        _authorize(http)
    except ApiError:
        return False
    return True


def _authorize(http: Request) -> None:
    key = http.app.state.serving.api_key
    if not key:
        return
    scheme, _, given = http.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not given:
        given = http.headers.get("x-api-key", "")  # how Anthropic's clients send it
    if not given:
        raise ApiError(
            401, "You didn't provide an API key: send `Authorization: Bearer <key>`.", code="invalid_api_key"
        )
    if not secrets.compare_digest(given.strip().encode(), key.encode()):
        raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key")


def _json(payload: object, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(msgspec.json.encode(payload), status, headers, media_type="application/json")


async def _api_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    headers = dict(exc.headers)
    if exc.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return _json(exc.body, exc.status, headers)


async def _http_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    error = ApiError(exc.status_code, str(exc.detail), type=kind)
    return _json(error.body, exc.status_code, dict(exc.headers or {}))


async def _client_gone(http: Request, _: Exception) -> Response:
    # The client closed its connection before sending the whole body: nobody is left to answer,
    # and nothing is wrong with us, so one line and no traceback.
    log.info("client disconnected before sending its whole request", path=http.url.path)
    return Response(status_code=400)


async def _unexpected_error(_: Request, exc: Exception) -> Response:
    log.error("unhandled error", error=repr(exc))
    error = ApiError(500, f"Internal error: {type(exc).__name__}: {exc}", type="server_error")
    return _json(error.body, 500)
