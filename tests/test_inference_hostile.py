"""The inference HTTP API against hostile input: oversized bodies, out-of-range fields, clients
that vanish mid-body.

Body limits and validation run in this process on uvicorn (``FakeEngine``); memory, latency under
a burst and the log of a disconnect are checked on a real inference replica process.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import msgspec
import openai
import pytest

from artery.ops.stack import ServiceProcess
from artery.services.inference.api import create_app
from artery.services.inference.chat import MAX_CHARS_PER_TOKEN
from artery.services.inference.serving import ServingState
from artery.shared.control_client import live_replicas
from tests.helpers import CharTokenizer, FakeEngine, wait_for
from tests.test_inference_api import USER
from tests.test_inference_api import serving_app as serving
from tests.test_inference_service import MODEL, PROJECT, start_replica

LIMIT = 64 * 1024
GOOD = {"model": "fake", "messages": USER, "max_tokens": 4}


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
async def server(engine) -> AsyncIterator[tuple[str, int]]:
    async with serving(create_app(ServingState(engine, "fake"), max_body_bytes=LIMIT)) as address:
        yield address


async def exchange(address: tuple[str, int], head: bytes, body_parts: list[bytes]) -> tuple[int, dict]:
    """Send a raw request (the body possibly incomplete) and read one response: (status, JSON)."""
    reader, writer = await asyncio.open_connection(*address)
    try:
        writer.write(head)
        for part in body_parts:
            writer.write(part)
        await writer.drain()
        status_line, _, rest = (await reader.readuntil(b"\r\n\r\n")).partition(b"\r\n")
        headers = dict(line.split(b": ", 1) for line in rest.strip().split(b"\r\n"))
        payload = await reader.readexactly(int(headers[b"content-length"]))
        return int(status_line.split()[1]), json.loads(payload)
    finally:
        writer.close()


def request_head(**headers: str) -> bytes:
    lines = [
        "POST /v1/chat/completions HTTP/1.1",
        "Host: test",
        "Content-Type: application/json",
        *(f"{name.replace('_', '-')}: {value}" for name, value in headers.items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def assert_openai_error(error: dict, code: str | None = None, param: str | None = None) -> None:
    assert set(error) == {"error"}, error
    assert set(error["error"]) == {"message", "type", "param", "code"}, error
    assert error["error"]["type"] == "invalid_request_error" and error["error"]["message"]
    if code is not None:
        assert error["error"]["code"] == code, error
    if param is not None:
        assert error["error"]["param"] == param, error


def body_of_size(size: int) -> bytes:
    """A valid request whose JSON is exactly ``size`` bytes (padded with an ignored field)."""
    empty = msgspec.json.encode({**GOOD, "padding": ""})
    return msgspec.json.encode({**GOOD, "padding": "x" * (size - len(empty))})


# --------------------------------------------------------------------------- body size


async def test_a_declared_length_over_the_limit_is_refused_before_any_body_is_sent(server, engine):
    # Not one byte of body is sent: the 413 can only come from the header.
    status, error = await exchange(server, request_head(Content_Length=str(LIMIT + 1)), [])
    assert status == 413
    assert_openai_error(error, code="request_too_large")
    assert str(LIMIT) in error["error"]["message"]
    assert engine.requests == []


async def test_a_chunked_body_is_refused_as_it_passes_the_limit_before_it_ends(server, engine):
    chunk = b"x" * 16 * 1024
    chunks = [b"%x\r\n%s\r\n" % (len(chunk), chunk)] * (LIMIT // len(chunk) + 1)
    # No terminating chunk is ever sent: the 413 comes from counting what was read.
    status, error = await exchange(server, request_head(Transfer_Encoding="chunked"), chunks)
    assert status == 413
    assert_openai_error(error, code="request_too_large")
    assert engine.requests == []


async def test_bodies_up_to_the_limit_are_served_and_the_connection_outlives_a_413(server):
    base_url = f"http://{server[0]}:{server[1]}"
    async with httpx.AsyncClient(base_url=base_url) as client:
        at_limit = await client.post("/v1/chat/completions", content=body_of_size(LIMIT))
        assert at_limit.status_code == 200, at_limit.text

        async def chunked():
            yield body_of_size(LIMIT + 1)

        for content in (body_of_size(LIMIT + 1), chunked()):
            over = await client.post("/v1/chat/completions", content=content)
            assert over.status_code == 413
            assert_openai_error(over.json(), code="request_too_large")
            after = await client.post("/v1/chat/completions", json=GOOD)  # same connection
            assert after.status_code == 200, after.text


# --------------------------------------------------------------------------- prompt length


class CountingTokenizer(CharTokenizer):
    """Renders text when asked not to tokenise, and counts the times it was asked to."""

    def __init__(self) -> None:
        self.tokenized = 0

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=False, tokenize=True, **kw):
        rendered = super().apply_chat_template(messages, tools, add_generation_prompt, **kw)
        if not tokenize:
            return self.decode(rendered["input_ids"])
        self.tokenized += 1
        return rendered


async def in_process(engine: FakeEngine, document: dict) -> httpx.Response:
    transport = httpx.ASGITransport(app=create_app(ServingState(engine, "fake")))
    async with httpx.AsyncClient(transport=transport, base_url="http://inference") as client:
        return await client.post("/v1/chat/completions", json=document)


async def test_a_prompt_far_over_the_context_is_refused_without_tokenising_it(engine):
    engine.tokenizer = tokenizer = CountingTokenizer()
    text = "x" * (engine.max_context * MAX_CHARS_PER_TOKEN + 1)
    response = await in_process(engine, {**GOOD, "messages": [{"role": "user", "content": text}]})
    assert response.status_code == 400
    assert_openai_error(response.json(), code="context_length_exceeded", param="messages")
    assert "characters" in response.json()["error"]["message"]
    assert tokenizer.tokenized == 0


async def test_text_the_template_drops_does_not_count_against_the_context(engine):
    # This template writes no reasoning: a long one from an earlier turn still leaves a short prompt.
    engine.tokenizer = tokenizer = CountingTokenizer()
    reasoning = "r" * (engine.max_context * MAX_CHARS_PER_TOKEN + 1)
    messages = [
        {"role": "user", "content": "Hi."},
        {"role": "assistant", "content": "Hello.", "reasoning_content": reasoning},
        *USER,
    ]
    response = await in_process(engine, {**GOOD, "messages": messages})
    assert response.status_code == 200, response.text
    assert tokenizer.tokenized == 1


# --------------------------------------------------------------------------- field validation


class SizedTokenizer(CharTokenizer):
    def __len__(self) -> int:
        return 1000


ASSISTANT_CALL = {
    "role": "assistant",
    "content": None,
    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}],
}


@pytest.mark.parametrize(
    ("field", "value", "param"),
    [
        ("logit_bias", {"5": 1e308}, "logit_bias"),
        ("logit_bias", {"5": -101}, "logit_bias"),
        ("logit_bias", {"hello": 1}, "logit_bias"),
        ("logit_bias", {"-1": 1}, "logit_bias"),
        ("logit_bias", {"1000": 1}, "logit_bias"),  # past the vocabulary
        ("logit_bias", [1, 2], "logit_bias"),
        ("frequency_penalty", 1e308, "frequency_penalty"),
        ("frequency_penalty", -2.5, "frequency_penalty"),
        ("presence_penalty", 1e308, "presence_penalty"),
        ("presence_penalty", "high", "presence_penalty"),
        ("response_format", "garbage", "response_format"),
        ("response_format", {}, "response_format"),
        ("response_format", {"type": "xml"}, "response_format.type"),
        ("response_format", {"type": "json_schema"}, "response_format"),
        (
            "response_format",
            {"type": "json_schema", "json_schema": {"name": "a b"}},
            "response_format.json_schema.name",
        ),
        ("messages", [*USER, ASSISTANT_CALL], "messages[1].tool_calls[0].function.arguments"),
    ],
)
async def test_a_field_out_of_range_is_a_400_naming_it(engine, field, value, param):
    engine.tokenizer = SizedTokenizer()
    response = await in_process(engine, {**GOOD, field: value})
    assert response.status_code == 400, response.text
    assert_openai_error(response.json(), param=param)
    assert engine.requests == []


async def test_fields_in_openais_ranges_are_accepted(engine):
    engine.tokenizer = SizedTokenizer()
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    document = {
        **GOOD,
        "messages": [*USER, {"role": "assistant", "content": None, "tool_calls": [call]}],
        "logit_bias": {"0": -100, "999": 100},
        "frequency_penalty": -2,
        "presence_penalty": 2,
        "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": {}}},
    }
    for response_format in ({"type": "text"}, {"type": "json_object"}, document["response_format"]):
        response = await in_process(engine, {**document, "response_format": response_format})
        assert response.status_code == 200, response.text
    assert len(engine.requests) == 3


# --------------------------------------------------------------------------- a real replica


def vm_rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for process {pid}")


@pytest.fixture
async def replica(stack, js) -> AsyncIterator[tuple[str, ServiceProcess]]:
    """One inference replica process on the tiny model: (base URL, its ServiceProcess)."""
    start_replica(stack, "replica-h")
    process = stack.processes["replica-h"]
    await asyncio.to_thread(process.wait_ready, 120)
    (info,) = await wait_for(lambda: live_replicas(js, PROJECT, MODEL), timeout=30)
    yield info.url, process


async def ask(client: openai.AsyncOpenAI) -> float:
    """Seconds one small completion takes."""
    started = time.monotonic()
    response = await client.chat.completions.create(model=MODEL, messages=USER, max_tokens=4, temperature=0)
    assert response.choices[0].model_extra["token_ids"]
    return time.monotonic() - started


def chat_body(content: bytes) -> bytes:
    return b'{"model": "agent", "messages": [{"role": "user", "content": "' + content + b'"}]}'


@pytest.mark.timeout(240)
async def test_a_burst_of_oversized_bodies_neither_slows_valid_requests_nor_keeps_memory(replica):
    url, process = replica
    # Over the 8 MiB default: refused unread. Under it, but more characters than the context could
    # hold: read, then refused untokenised.
    over_limit = chat_body(b"x" * (20 << 20))
    over_context = chat_body("é".encode() * (3 << 20))
    megabyte = 1 << 20

    async def post(raw: httpx.AsyncClient, body: bytes, declared: bool, begun: asyncio.Event) -> int:
        async def parts():
            for start in range(0, len(body), megabyte):
                yield body[start : start + megabyte]
                begun.set()  # the server has a first megabyte: the request is in flight

        # With a Content-Length, refused on the header; without (chunked), by counting.
        headers = {"Content-Length": str(len(body))} if declared else {}
        return (await raw.post("/v1/chat/completions", content=parts(), headers=headers)).status_code

    async with (
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as client,
        httpx.AsyncClient(base_url=url, timeout=60) as raw,
    ):
        alone = await ask(client)  # also warms the serving path up before the baseline
        baseline = vm_rss_bytes(process.proc.pid)
        for _ in range(2):
            bodies = [(over_limit, True), (over_limit, False)] * 2 + [(over_context, True)] * 2
            begun = [asyncio.Event() for _ in bodies]
            burst = [
                asyncio.create_task(post(raw, body, declared, event))
                for (body, declared), event in zip(bodies, begun, strict=True)
            ]
            await asyncio.gather(*(event.wait() for event in begun))
            during = await ask(client)
            assert await asyncio.gather(*burst) == [413] * 4 + [400] * 2
        after = vm_rss_bytes(process.proc.pid)

    # Before the limits, each 20 MB body took 14 s to tokenise and a valid request waited 41 s.
    assert during < max(5.0, 10 * alone), (alone, during)
    assert after - baseline < 64 << 20, f"RSS grew from {baseline >> 20} MiB to {after >> 20} MiB"


@pytest.mark.timeout(240)
async def test_a_client_that_disconnects_mid_body_is_logged_in_one_line_without_a_traceback(replica):
    url, process = replica
    host, port = httpx.URL(url).host, httpx.URL(url).port
    _, writer = await asyncio.open_connection(host, port)
    writer.write(request_head(Content_Length="100000") + b'{"model": "agent", "mess')
    await writer.drain()
    writer.close()  # 24 of the 100000 bytes promised
    await writer.wait_closed()

    def log_text() -> str:
        return process.log_path.read_text(errors="replace")

    async def disconnect_logged() -> bool:
        return "client disconnected" in log_text()

    await wait_for(disconnect_logged, timeout=30)
    log = log_text()
    assert "Traceback" not in log and "ClientDisconnect" not in log, log[-3000:]
    assert sum("client disconnected" in line for line in log.splitlines()) == 1
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as client:
        await ask(client)
