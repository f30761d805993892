"""The inference HTTP API, served by uvicorn in this process, driven by the official OpenAI client.

A fake engine with a character-level tokenizer answers deterministically, so every field can be
checked exactly; one smoke test runs the real ``TransformersEngine`` on the tiny random Qwen2.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator

import httpx
import openai
import pytest
import uvicorn

from artery.services.inference.api import create_app
from artery.services.inference.engine.base import (
    Completion,
    GenerationRequest,
    UnknownAdapter,
)
from artery.services.inference.serving import EnginePaused, ServingState
from artery.services.inference.streaming import TextFilter
from tests.helpers import EOS, REPLY, TOOL_REPLY, CharTokenizer, FakeEngine

# --------------------------------------------------------------------------- fixtures


@contextlib.asynccontextmanager
async def serving_app(app) -> AsyncIterator[tuple[str, int]]:
    """``app`` on uvicorn, on a free port of this host, for the duration of the block: (host, port)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if task.done():
                task.result()
            await asyncio.sleep(0.01)
        yield sock.getsockname()
    finally:
        server.should_exit = True
        await task
        sock.close()


@contextlib.asynccontextmanager
async def serving(state: ServingState) -> AsyncIterator[str]:
    """The app on uvicorn, on a free port of this host, for the duration of the block."""
    async with serving_app(create_app(state)) as (host, port):
        yield f"http://{host}:{port}"


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def state(engine) -> ServingState:
    return ServingState(engine, "fake")


@pytest.fixture
async def base_url(state) -> AsyncIterator[str]:
    async with serving(state) as url:
        yield url


@pytest.fixture
async def client(base_url) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0) as client:
        yield client


USER = [{"role": "user", "content": "Say hello."}]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def _ids(text: str) -> list[int]:
    return CharTokenizer().encode(text)


# --------------------------------------------------------------------------- completions


async def test_chat_completion_has_openai_shape_and_sampled_ids(client, engine):
    response = await client.chat.completions.create(model="fake", messages=USER)
    assert response.object == "chat.completion"
    assert response.id.startswith("chatcmpl-")
    assert response.model == "fake@0"
    (choice,) = response.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == REPLY
    assert choice.message.tool_calls is None
    assert choice.finish_reason == "stop"
    assert choice.logprobs is None
    prompt = _ids("<user>Say hello.\n<assistant>")
    assert response.model_extra["prompt_token_ids"] == prompt
    assert choice.model_extra["token_ids"] == [*_ids(REPLY), EOS]
    assert response.usage.prompt_tokens == len(prompt)
    assert response.usage.completion_tokens == len(REPLY) + 1
    assert response.usage.total_tokens == len(prompt) + len(REPLY) + 1
    sent = engine.requests[-1]
    assert sent.prompt_token_ids == prompt and sent.adapter is None
    assert sent.params.max_tokens == engine.max_context - len(prompt)  # the room left
    assert sent.request_id == response.id


async def test_parameters_reach_the_engine(client, engine):
    await client.chat.completions.create(
        model="fake", messages=USER, temperature=0.0, top_p=0.5, max_completion_tokens=7, seed=3, stop="x"
    )
    params = engine.requests[-1].params
    assert (params.temperature, params.top_p, params.max_tokens, params.seed, params.stop) == (
        0.0,
        0.5,
        7,
        3,
        ("x",),
    )
    response = await client.chat.completions.create(model="fake", messages=USER, max_tokens=5)
    assert response.choices[0].message.content == REPLY[:5]
    assert response.choices[0].finish_reason == "length"
    assert response.choices[0].model_extra["token_ids"] == _ids(REPLY[:5])


async def test_stop_string_is_cut_from_the_text_but_not_from_the_ids(client):
    response = await client.chat.completions.create(model="fake", messages=USER, stop=["world", "zzz"])
    choice = response.choices[0]
    assert choice.message.content == "Hello, "
    assert choice.finish_reason == "stop"
    assert choice.model_extra["token_ids"] == _ids("Hello, world")


async def test_n_completions(client):
    response = await client.chat.completions.create(model="fake", messages=USER, n=2)
    assert [c.index for c in response.choices] == [0, 1]
    assert all(c.message.content == REPLY for c in response.choices)
    assert response.usage.completion_tokens == 2 * (len(REPLY) + 1)


async def test_logprobs_and_top_logprobs(client):
    response = await client.chat.completions.create(
        model="fake", messages=USER, logprobs=True, top_logprobs=2
    )
    choice = response.choices[0]
    entries = choice.logprobs.content
    ids = choice.model_extra["token_ids"]
    assert len(entries) == len(ids) == len(REPLY) + 1
    first = entries[0]
    assert first.token == "H" and first.bytes == [ord("H")]
    assert first.logprob == pytest.approx(-0.05)
    assert [t.token for t in first.top_logprobs] == ["H", "I"]
    assert [t.logprob for t in first.top_logprobs] == pytest.approx([-0.05, -1.05])
    assert first.model_extra["token_id"] == ids[0]
    assert entries[-1].token == "<|im_end|>"  # the end token is sampled, and trained on, too
    assert "".join(e.token for e in entries[:-1]) == REPLY
    plain = await client.chat.completions.create(model="fake", messages=USER, logprobs=True)
    assert plain.choices[0].logprobs.content[0].top_logprobs == []


async def test_tool_calls_are_parsed(client, engine):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    response = await client.chat.completions.create(model="fake", messages=messages, tools=[WEATHER_TOOL])
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert engine.tokenizer.decode(response.model_extra["prompt_token_ids"]).startswith("<tools>[")
    # With tool_choice "none" the text stays text.
    response = await client.chat.completions.create(
        model="fake", messages=messages, tools=[WEATHER_TOOL], tool_choice="none"
    )
    assert response.choices[0].message.content == TOOL_REPLY
    assert response.choices[0].finish_reason == "stop"


async def test_history_with_tool_calls_renders(client, engine):
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"a": 1}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    await client.chat.completions.create(model="fake", messages=messages, tools=[WEATHER_TOOL])
    prompt = engine.tokenizer.decode(engine.requests[-1].prompt_token_ids)
    assert "<user>Weather?\n<assistant>\n<tool>sunny\n<assistant>" in prompt
    rendered = engine.tokenizer.last_messages[1]
    assert rendered["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"a": 1}}
    assert engine.tokenizer.last_messages[2]["tool_call_id"] == "call_1"


# --------------------------------------------------------------------------- streaming


async def _collect(client, model="fake", **kwargs):
    stream = await client.chat.completions.create(model=model, stream=True, **kwargs)
    return [chunk async for chunk in stream]


async def test_streaming_assembles_the_same_answer(client):
    chunks = await _collect(client, messages=USER, stream_options={"include_usage": True})
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].model_extra["prompt_token_ids"] == _ids("<user>Say hello.\n<assistant>")
    body = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in body) == REPLY
    assert [c.choices[0].finish_reason for c in body if c.choices[0].finish_reason] == ["stop"]
    ids = [i for c in body for i in (c.choices[0].model_extra.get("token_ids") or [])]
    assert ids == [*_ids(REPLY), EOS]
    usage = chunks[-1].usage
    assert chunks[-1].choices == []
    assert (usage.completion_tokens, usage.total_tokens) == (len(ids), usage.prompt_tokens + len(ids))


async def test_streaming_n_stop_and_logprobs(client):
    chunks = await _collect(client, messages=USER, n=2, stop=["world"], logprobs=True, top_logprobs=1)
    assert all(c.usage is None for c in chunks)
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert "".join(ch.delta.content or "" for ch in mine) == "Hello, "
        assert [ch.finish_reason for ch in mine if ch.finish_reason] == ["stop"]
        entries = [e for ch in mine if ch.logprobs for e in ch.logprobs.content]
        assert "".join(e.token for e in entries) == "Hello, world"
        assert all(len(e.top_logprobs) == 1 for e in entries)


async def test_streaming_tool_calls(client):
    chunks = await _collect(
        client, messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER_TOOL], tool_choice="auto"
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    content = "".join(d.content or "" for d in deltas)
    assert content == "Checking.\n"  # up to the tool call, never a piece of its tag
    calls = [call for d in deltas for call in d.tool_calls or []]
    assert len(calls) == 1
    assert calls[0].index == 0 and calls[0].id.startswith("call_")
    assert calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


async def test_a_stream_stays_admitted_until_it_ends_or_its_client_leaves(client, engine, state):
    inside = 0
    left = asyncio.Event()

    @contextlib.asynccontextmanager
    async def admit():
        nonlocal inside
        inside += 1
        try:
            yield
        finally:
            inside -= 1
            left.set()

    state.admit = admit
    chunks = await _collect(client, messages=USER)
    assert inside == 0 and chunks[-1].choices[0].finish_reason == "stop"
    left.clear()
    engine.delay = 0.05  # ~1.3 s for the whole answer
    stream = await client.chat.completions.create(model="fake", messages=USER, stream=True)
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            break
    assert inside == 1  # the pause gate sees it in flight
    await stream.close()
    await asyncio.wait_for(left.wait(), 1.0)  # the engine stream was cancelled, not run to the end
    assert inside == 0


def test_text_filter_holds_back_what_may_become_a_stop_string_or_a_tool_call():
    text = TextFilter(("STOP",), "<tool_call>")
    assert text.feed("Hi S") == "Hi "
    assert text.feed("T") == ""
    assert text.feed("x <tool") == "STx "
    assert text.feed("_call>{}") == ""
    assert text.finish() == "" and text.tail == "<tool_call>{}"
    text = TextFilter(("STOP",), None)
    assert text.feed("abST") == "ab"
    assert text.feed("OP and more") == ""
    assert text.stopped and text.text == "ab"


# --------------------------------------------------------------------------- models and adapters


async def test_models_lists_every_served_name(client, engine, base_url):
    engine.loaded = ["fake@3", "fake@1", "other@2", "not-a-step"]
    models = await client.models.list()
    assert [m.id for m in models.data] == ["fake", "fake@0", "fake@1", "fake@3"]
    assert {m.owned_by for m in models.data} == {"artery"}
    assert all(m.object == "model" for m in models.data)
    response = await client.chat.completions.create(model="fake", messages=USER)
    assert response.model == "fake@3" and engine.requests[-1].adapter == "fake@3"
    response = await client.chat.completions.create(model="fake@1", messages=USER)
    assert response.model == "fake@1" and response.choices[0].message.content == f"{REPLY} [fake@1]"
    response = await client.chat.completions.create(model="fake@0", messages=USER)
    assert engine.requests[-1].adapter is None
    async with httpx.AsyncClient(base_url=base_url) as http:
        assert (await http.get("/health")).json() == {"status": "ok", "adapters": engine.loaded}


async def test_a_request_held_by_a_pause_gets_the_adapter_loaded_during_it(client, engine, state):
    @contextlib.asynccontextmanager
    async def admit():
        engine.loaded = ["fake@5"]  # the checkpoint that the pause was for
        yield

    state.admit = admit
    response = await client.chat.completions.create(model="fake", messages=USER)
    assert response.model == "fake@5" and engine.requests[-1].adapter == "fake@5"


async def test_a_bare_name_whose_step_was_retired_mid_request_is_served_by_the_newest(client, engine):
    """Asynchronous training: step 5 is resolved, then retired (retention) as step 6 is loaded,
    before the engine runs the request. The bare name means "the newest": step 6 answers. A
    request that named step 5 itself gets the 404."""
    engine.loaded = ["fake@5"]
    generate = engine.generate

    async def retiring(request: GenerationRequest) -> list[Completion]:
        if request.adapter == "fake@5":
            engine.loaded = ["fake@6"]
            raise UnknownAdapter("fake@5")
        return await generate(request)

    engine.generate = retiring
    response = await client.chat.completions.create(model="fake", messages=USER)
    assert response.model == "fake@6" and engine.requests[-1].adapter == "fake@6"
    assert response.choices[0].model_extra["served_model"] == "fake@6"
    engine.loaded = ["fake@5", "fake@6"]
    with pytest.raises(openai.NotFoundError, match="not loaded"):
        await client.chat.completions.create(model="fake@5", messages=USER)


# --------------------------------------------------------------------------- errors


async def test_unknown_model_is_404(client, engine):
    engine.loaded = ["fake@2"]
    for name in ("nope", "fake@7", "fake@x"):
        with pytest.raises(openai.NotFoundError) as caught:
            await client.chat.completions.create(model=name, messages=USER)
        assert caught.value.code == "model_not_found"
        assert caught.value.body["param"] == "model"


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"temperature": 5}, "temperature"),
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ],
)
async def test_invalid_parameters_are_400(client, kwargs, param):
    kwargs = {"messages": USER, **kwargs}
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(model="fake", **kwargs)
    assert caught.value.body["type"] == "invalid_request_error"
    assert caught.value.body["param"] == param


async def test_prompt_longer_than_the_context_is_400(client, engine):
    long = [{"role": "user", "content": "x" * engine.max_context}]
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(model="fake", messages=long)
    assert caught.value.code == "context_length_exceeded"
    assert str(engine.max_context) in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(model="fake", messages=USER, max_tokens=engine.max_context)
    assert caught.value.code == "context_length_exceeded"
    prompt = len(_ids("<user>Say hello.\n<assistant>"))
    assert f"{prompt + engine.max_context} tokens ({prompt} in the messages" in caught.value.message
    assert engine.requests == []


async def test_paused_past_the_wait_limit_is_503(client, state, base_url):
    @contextlib.asynccontextmanager
    async def admit():
        raise EnginePaused("waited 30 s", retry_after=12)
        yield

    state.admit = admit
    state.is_paused = lambda: True
    for stream in (False, True):
        with pytest.raises(openai.APIStatusError) as caught:
            await client.chat.completions.create(model="fake", messages=USER, stream=stream)
        assert caught.value.status_code == 503
        assert caught.value.code == "engine_paused"
        assert caught.value.response.headers["retry-after"] == "12"
    async with httpx.AsyncClient(base_url=base_url) as http:
        assert (await http.get("/health")).json()["status"] == "paused"


async def test_engine_failure_is_500_with_a_message(client):
    for stream in (False, True):
        with pytest.raises(openai.InternalServerError) as caught:
            await client.chat.completions.create(
                model="fake", messages=[{"role": "user", "content": "explode"}], stream=stream
            )
        assert caught.value.code == "engine_error"
        assert "out of fake memory" in caught.value.message


@pytest.mark.parametrize(
    "body",
    [b"{not json", b"[1, 2]", b'{"model": "fake"}', b'{"model": "fake", "messages": "hi"}'],
)
async def test_bad_bodies_are_400_in_openai_shape(base_url, body):
    async with httpx.AsyncClient(base_url=base_url) as http:
        response = await http.post("/v1/chat/completions", content=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]


async def test_unknown_route_is_404_in_openai_shape(base_url):
    async with httpx.AsyncClient(base_url=base_url) as http:
        response = await http.get("/v1/nothing")
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "invalid_request_error"


async def test_api_key(state, base_url):
    state.api_key = "sesame"
    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="wrong", max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError) as caught:
            await client.chat.completions.create(model="fake", messages=USER)
        assert caught.value.code == "invalid_api_key"
    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="sesame", max_retries=0) as client:
        assert (await client.chat.completions.create(model="fake", messages=USER)).choices
    async with httpx.AsyncClient(base_url=base_url) as http:
        missing = await http.get("/v1/models")
        assert missing.status_code == 401
        assert missing.json()["error"]["code"] == "invalid_api_key"
        assert (await http.get("/health")).status_code == 200  # probes need no key


# --------------------------------------------------------------------------- the real engine


@pytest.mark.slow
async def test_smoke_with_the_transformers_engine():
    tiny = pytest.importorskip("artery.shared.tiny_model")
    engines = pytest.importorskip("artery.services.inference.engine.transformers_engine")
    engine = engines.TransformersEngine(tiny.tiny_model_path(), max_context=256)
    await engine.start()
    try:
        async with serving(ServingState(engine, "tiny")) as url:
            async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client:
                response = await client.chat.completions.create(
                    model="tiny", messages=USER, max_tokens=8, logprobs=True, top_logprobs=2, seed=1
                )
                choice = response.choices[0]
                ids = choice.model_extra["token_ids"]
                assert 1 <= len(ids) <= 8 and len(choice.logprobs.content) == len(ids)
                assert (
                    response.model_extra["prompt_token_ids"][-3:]
                    == engine.tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)[-3:]
                )
                chunks = await _collect(client, "tiny", messages=USER, max_tokens=8, seed=1)
                streamed = [
                    i for c in chunks if c.choices for i in (c.choices[0].model_extra.get("token_ids") or [])
                ]
                assert streamed == ids  # same seed, same tokens, whichever way they are asked for
                assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
                    choice.message.content
                )
    finally:
        await engine.close()
