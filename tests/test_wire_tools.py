"""The wire APIs beside chat on the deterministic ``FakeEngine`` (``tests/helpers.py``), where the
answer is known to the character: tool calls parsed into each API's own shape, stop strings, the
pause gate's 503, plain and streamed alike, through the official ``openai`` and ``anthropic``
clients. (``test_wire_apis.py`` runs the same routes on the real engine.)
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator

import anthropic
import httpx
import openai
import pytest

from artery.services.inference.serving import EnginePaused, ServingState
from tests.helpers import FakeEngine
from tests.test_wire_apis import ANTHROPIC_WEATHER, WEATHER, _serving

MODEL = "fake"
ASK = "What is the weather in Paris?"


@pytest.fixture
def state() -> ServingState:
    return ServingState(FakeEngine(), MODEL)


@pytest.fixture
async def base_url(state) -> AsyncIterator[str]:
    async with _serving(state) as url:
        yield url


@pytest.fixture
async def oai(base_url) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0) as client:
        yield client


@pytest.fixture
async def claude(base_url) -> AsyncIterator[anthropic.AsyncAnthropic]:
    async with anthropic.AsyncAnthropic(base_url=base_url, api_key="unused", max_retries=0) as client:
        yield client


async def test_responses_turn_a_tool_call_into_a_function_call_item(oai):
    plain = await oai.responses.create(model=MODEL, input=ASK, tools=[WEATHER])
    assert plain.status == "completed"
    _, call = plain.output
    assert plain.output_text == "Checking."
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"} and call.call_id.startswith("call_")
    stream = await oai.responses.create(model=MODEL, input=ASK, tools=[WEATHER], stream=True)
    events = [event async for event in stream]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    # The call itself never streams as text (the newline before it does, as in chat's stream).
    assert deltas.strip() == "Checking."
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert json.loads(done.arguments) == {"city": "Paris"}
    final = events[-1].response
    assert [item.type for item in final.output] == ["message", "function_call"]
    assert final.model_extra["token_ids"] == plain.model_extra["token_ids"]


async def test_messages_turn_a_tool_call_into_a_tool_use_block(claude):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": ASK}], tools=[ANTHROPIC_WEATHER])
    plain = await claude.messages.create(**kwargs, max_tokens=100)
    assert plain.stop_reason == "tool_use"
    text, call = plain.content
    assert text.type == "text" and text.text == "Checking."
    assert call.type == "tool_use" and call.name == "get_weather" and call.input == {"city": "Paris"}
    async with claude.messages.stream(**kwargs, max_tokens=100) as stream:
        final = await stream.get_final_message()
    assert [block.type for block in final.content] == ["text", "tool_use"]
    assert final.content[0].text.strip() == "Checking." and final.content[1].input == {"city": "Paris"}
    assert final.stop_reason == "tool_use"


async def test_a_stop_sequence_ends_the_text_and_is_named(claude, oai):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=100)
    plain = await claude.messages.create(**kwargs, stop_sequences=["world"])
    assert plain.content[0].text == "Hello, "
    assert (plain.stop_reason, plain.stop_sequence) == ("stop_sequence", "world")
    async with claude.messages.stream(**kwargs, stop_sequences=["world"]) as stream:
        final = await stream.get_final_message()
    assert final.content[0].text == "Hello, " and final.stop_sequence == "world"
    # The ids run up to the end of the stop string: what was sampled, for training.
    assert len(plain.model_extra["token_ids"]) == len("Hello, world") == final.usage.output_tokens
    completion = await oai.completions.create(model=MODEL, prompt="Hi", stop=["world"], max_tokens=50)
    assert completion.choices[0].text == "Hello, " and completion.choices[0].finish_reason == "stop"
    stream = await oai.completions.create(
        model=MODEL, prompt="Hi", stop=["world"], max_tokens=50, stream=True
    )
    assert "".join([c.choices[0].text async for c in stream if c.choices]) == "Hello, "


async def test_paused_past_the_wait_limit_is_503_on_every_route(state, oai, claude):
    @contextlib.asynccontextmanager
    async def admit():
        raise EnginePaused("waited 30 s", retry_after=12)
        yield

    state.admit = admit
    for stream in (False, True):
        with pytest.raises(openai.APIStatusError) as caught:
            await oai.completions.create(model=MODEL, prompt="Hi", stream=stream)
        assert caught.value.status_code == 503 and caught.value.response.headers["retry-after"] == "12"
        with pytest.raises(openai.APIStatusError) as caught:
            await oai.responses.create(model=MODEL, input="Hi", stream=stream)
        assert caught.value.status_code == 503
        with pytest.raises(anthropic.APIStatusError) as caught_anthropic:
            await claude.messages.create(
                model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=8, stream=stream
            )
        assert caught_anthropic.value.status_code == 503


async def test_served_names_route_as_chat_routes_them(state, oai):
    state.engine.loaded.append(f"{MODEL}@2")
    response = await oai.completions.create(model=MODEL, prompt="Hi", max_tokens=50)
    assert response.model == f"{MODEL}@2" and response.choices[0].text.endswith(f"[{MODEL}@2]")
    response = await oai.completions.create(model=f"{MODEL}@0", prompt="Hi", max_tokens=50)
    assert response.model == f"{MODEL}@0" and response.choices[0].text == "Hello, world! I am fake."


async def test_the_responses_stream_helper_gets_a_final_response_even_when_cut(oai):
    async with oai.responses.stream(model=MODEL, input="Hi", max_output_tokens=5) as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_response()
    assert kinds[-1] == "response.completed"
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    assert final.output_text == "Hello" and final.usage.output_tokens == 5
    assert len(final.model_extra["token_ids"]) == len(final.model_extra["token_logprobs"]) == 5


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"model": MODEL, "prompt": ["a", "b"]}, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": "Hi", "logprobs": 9}, "logprobs"),
        ("/v1/completions", {"model": MODEL, "prompt": "Hi", "echo": True}, "echo"),
        ("/v1/responses", {"model": MODEL, "input": [{"type": "web_search_call"}]}, "input[0]"),
        ("/v1/responses", {"model": MODEL, "input": "Hi", "previous_response_id": "resp_1"}, None),
        ("/v1/responses", {"model": MODEL, "input": [{"role": "user"}]}, "input[0]"),
        ("/v1/messages", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}, "max_tokens"),
        (
            "/v1/messages",
            {"model": MODEL, "max_tokens": 4, "messages": [{"role": "tool", "content": "x"}]},
            None,
        ),
    ],
)
async def test_bad_requests_are_400_naming_the_field(base_url, state, path, body, param):
    async with httpx.AsyncClient(base_url=base_url) as http:
        response = await http.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"] == param
    assert state.engine.requests == []  # refused before the engine saw anything
