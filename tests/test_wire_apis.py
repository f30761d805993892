"""The wire APIs beside chat, on the real ``TransformersEngine`` serving the tiny model, driven by
the official clients unchanged: ``openai`` (legacy Completions, Responses) and ``anthropic``
(Messages), plain and streamed. Each answer must parse in its client and carry the sampled
``token_ids`` with one ``token_logprobs`` entry each, as many as the usage's output tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator

import anthropic
import openai
import pytest
import uvicorn

from artery.services.inference.api import create_app
from artery.services.inference.serving import ServingState

pytestmark = pytest.mark.slow

MODEL = "tiny"
KEY = "wire-key"


@contextlib.asynccontextmanager
async def _serving(state: ServingState) -> AsyncIterator[str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(state), log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if task.done():
                task.result()
            await asyncio.sleep(0.01)
        host, port = sock.getsockname()
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        await task
        sock.close()


@pytest.fixture
async def engine() -> AsyncIterator[object]:
    tiny = pytest.importorskip("artery.shared.tiny_model")
    engines = pytest.importorskip("artery.services.inference.engine.transformers_engine")
    engine = engines.TransformersEngine(tiny.tiny_model_path(), max_context=1024)
    await engine.start()
    try:
        yield engine
    finally:
        await engine.close()


@pytest.fixture
async def base_url(engine) -> AsyncIterator[str]:
    async with _serving(ServingState(engine, MODEL, api_key=KEY)) as url:
        yield url


@pytest.fixture
async def oai(base_url) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0) as client:
        yield client


def _consistent(ids: list[int], logprobs: list[float], output_tokens: int) -> None:
    assert ids and all(isinstance(i, int) for i in ids)
    assert len(ids) == len(logprobs) == output_tokens
    assert all(lp <= 0.0 for lp in logprobs)


# --------------------------------------------------------------------------- /v1/completions


async def test_completions_carry_the_prompt_and_sampled_tokens(oai, engine):
    prompt = "The capital of France is"
    response = await oai.completions.create(model=MODEL, prompt=prompt, max_tokens=8, seed=3, logprobs=2)
    assert response.object == "text_completion" and response.model == f"{MODEL}@0"
    choice = response.choices[0]
    extra = choice.model_extra
    _consistent(extra["token_ids"], extra["token_logprobs"], response.usage.completion_tokens)
    # No chat template: the prompt's ids are the raw text's.
    assert extra["prompt_token_ids"] == engine.tokenizer.encode(prompt)
    assert response.usage.prompt_tokens == len(extra["prompt_token_ids"])
    assert choice.text == engine.tokenizer.decode(extra["token_ids"], skip_special_tokens=True)
    assert choice.finish_reason in ("stop", "length")
    assert choice.logprobs.token_logprobs == extra["token_logprobs"]
    assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs)


async def test_a_prompt_of_token_ids_is_continued_as_given(oai, engine):
    ids = engine.tokenizer.encode("Once upon a time")
    response = await oai.completions.create(model=MODEL, prompt=ids, max_tokens=4, seed=1)
    assert response.choices[0].model_extra["prompt_token_ids"] == ids
    with pytest.raises(openai.BadRequestError):
        await oai.completions.create(model=MODEL, prompt=[len(engine.tokenizer)], max_tokens=4)


async def test_streamed_completions_sample_what_a_plain_one_does(oai):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=8, seed=5)
    plain = (await oai.completions.create(**kwargs)).choices[0]
    stream = await oai.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    chunks = [chunk async for chunk in stream]
    ids = [i for c in chunks for ch in c.choices for i in (ch.model_extra.get("token_ids") or [])]
    logprobs = [x for c in chunks for ch in c.choices for x in (ch.model_extra.get("token_logprobs") or [])]
    usage = chunks[-1].usage
    _consistent(ids, logprobs, usage.completion_tokens)
    assert ids == plain.model_extra["token_ids"]  # same seed, same tokens
    assert "".join(ch.text for c in chunks for ch in c.choices) == plain.text
    assert chunks[0].choices[0].model_extra["prompt_token_ids"] == plain.model_extra["prompt_token_ids"]
    assert [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason] == [plain.finish_reason]


# --------------------------------------------------------------------------- /v1/responses

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
# A whole tool-using conversation as Responses input items: the call, its output, then a question.
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
    {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    {"role": "user", "content": [{"type": "input_text", "text": "And so?"}]},
]


async def test_responses_render_tool_history_and_carry_the_sampled_tokens(oai, engine):
    response = await oai.responses.create(
        model=MODEL, input=HISTORY, instructions="Be brief.", tools=[WEATHER], max_output_tokens=8
    )
    assert response.object == "response" and response.model == f"{MODEL}@0"
    assert response.status in ("completed", "incomplete")
    assert response.output[0].type == "message" and response.output[0].content[0].type == "output_text"
    extra = response.model_extra
    _consistent(extra["token_ids"], extra["token_logprobs"], response.usage.output_tokens)
    assert response.usage.input_tokens == len(extra["prompt_token_ids"])
    # The chat template saw every item: instructions, the call, its output, the last question.
    rendered = engine.tokenizer.decode(extra["prompt_token_ids"])
    for seen in ("Be brief.", "Paris", "sunny", "And so?"):
        assert seen in rendered
    text = engine.tokenizer.decode(extra["token_ids"], skip_special_tokens=True)
    assert response.output_text.strip() == text.strip() or response.output[1:]  # or it called a tool


async def test_streamed_responses_end_with_the_whole_response(oai):
    kwargs = dict(model=MODEL, input="Tell me a story.", max_output_tokens=8, temperature=0)
    plain = await oai.responses.create(**kwargs)
    stream = await oai.responses.create(**kwargs, stream=True)
    events = [event async for event in stream]
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    final = events[-1].response
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == plain.output_text  # greedy: the same tokens both ways
    assert final.model_extra["token_ids"] == plain.model_extra["token_ids"]
    _consistent(
        final.model_extra["token_ids"], final.model_extra["token_logprobs"], final.usage.output_tokens
    )
    assert [e.sequence_number for e in events] == list(range(len(events)))


# --------------------------------------------------------------------------- /v1/messages

ANTHROPIC_WEATHER = {
    "name": "get_weather",
    "description": "Weather of a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}
TOOL_TURNS = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": [
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
        ],
    },
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]},
]


@pytest.fixture
async def claude(base_url) -> AsyncIterator[anthropic.AsyncAnthropic]:
    # Anthropic's client sends the key as ``x-api-key``, not as a bearer token.
    async with anthropic.AsyncAnthropic(base_url=base_url, api_key=KEY, max_retries=0) as client:
        yield client


async def test_messages_render_tool_turns_and_carry_the_sampled_tokens(claude, engine):
    message = await claude.messages.create(
        model=MODEL, system="Be brief.", messages=TOOL_TURNS, tools=[ANTHROPIC_WEATHER], max_tokens=8
    )
    assert message.type == "message" and message.role == "assistant" and message.model == f"{MODEL}@0"
    assert message.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert all(block.type in ("text", "tool_use") for block in message.content)
    extra = message.model_extra
    _consistent(extra["token_ids"], extra["token_logprobs"], message.usage.output_tokens)
    assert message.usage.input_tokens == len(extra["prompt_token_ids"])
    rendered = engine.tokenizer.decode(extra["prompt_token_ids"])
    for seen in ("Be brief.", "Checking.", "Paris", "sunny"):
        assert seen in rendered


async def test_streamed_messages_assemble_what_a_plain_one_says(claude):
    # Greedy, so that both ways sample the same tokens; this client has no ``temperature`` argument.
    greedy = {"temperature": 0}
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Hi!"}], max_tokens=8, extra_body=greedy)
    plain = await claude.messages.create(**kwargs)
    async with claude.messages.stream(**kwargs) as stream:
        events = [event async for event in stream]
        final = await stream.get_final_message()
    delta = next(e for e in events if e.type == "message_delta")
    ids, logprobs = delta.model_extra["token_ids"], delta.model_extra["token_logprobs"]
    _consistent(ids, logprobs, final.usage.output_tokens)
    assert ids == plain.model_extra["token_ids"]  # greedy: the same tokens both ways
    assert final.content[0].text == (plain.content[0].text if plain.content else "")
    assert final.stop_reason == plain.stop_reason
    assert events[0].type == "message_start" and events[-1].type == "message_stop"


async def test_the_key_is_checked_on_every_wire_api(base_url):
    async with anthropic.AsyncAnthropic(base_url=base_url, api_key="wrong", max_retries=0) as client:
        with pytest.raises(anthropic.AuthenticationError):
            await client.messages.create(
                model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
            )
    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="wrong", max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError):
            await client.completions.create(model=MODEL, prompt="Hi", max_tokens=4)
        with pytest.raises(openai.AuthenticationError):
            await client.responses.create(model=MODEL, input="Hi", max_output_tokens=4)


async def test_unknown_models_and_overlong_requests_are_refused_as_chat_refuses_them(oai, claude):
    with pytest.raises(openai.NotFoundError):
        await oai.completions.create(model="other", prompt="Hi", max_tokens=4)
    with pytest.raises(openai.NotFoundError):
        await oai.responses.create(model=f"{MODEL}@7", input="Hi")
    with pytest.raises(anthropic.BadRequestError):  # more than the context (1024) holds
        await claude.messages.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2000
        )
