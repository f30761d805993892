"""Capture scopes (``with art.Trajectory()``, ``art.trajectory``, ``art.trajectory_group``) and the
exchanges they record through httpx, aiohttp and requests, for the four wire APIs.

The units talk over real HTTP to a small aiohttp server answering each API in the shape Artery's
inference does (extension fields included), plain and streamed; the last test drives the real
stack on the tiny model with the official clients and trains on what was captured.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import openai
import pytest
import requests
from aiohttp import ClientSession, web

import artery as art

IDS, LOGPROBS = [11, 12, 2], [-0.1, -0.2, -0.3]
TOOL = {"name": "lookup", "description": "Look a word up.", "parameters": {"type": "object"}}


# --------------------------------------------------------------------------- a fake endpoint


def _chat(body: dict[str, Any]) -> dict[str, Any]:
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": f"answer {len(body['messages'])}"},
        "finish_reason": "stop",
        "logprobs": None,
        "token_ids": IDS,
        "token_logprobs": LOGPROBS,
    }
    return {"id": "c1", "object": "chat.completion", "created": 0, "model": "agent@3", "choices": [choice]}


def _completion(body: dict[str, Any]) -> dict[str, Any]:
    choice = {
        "index": 0,
        "text": " done",
        "finish_reason": "stop",
        "logprobs": None,
        "token_ids": IDS,
        "token_logprobs": LOGPROBS,
        "prompt_token_ids": [1, 2],
    }
    return {"id": "t1", "object": "text_completion", "created": 0, "model": "agent@3", "choices": [choice]}


def _response(body: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": "r1",
        "object": "response",
        "created_at": 0,
        "model": "agent@4",
        "status": "completed",
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "output": [
            {
                "type": "message",
                "id": "m1",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": "thinking", "annotations": []}],
            },
            {
                "type": "function_call",
                "id": "f1",
                "call_id": "call_1",
                "name": "lookup",
                "arguments": '{"word": "x"}',
            },
        ],
        "token_ids": IDS,
        "token_logprobs": LOGPROBS,
    }


def _message(body: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "agent@4",
        "content": [
            {"type": "text", "text": "let me look"},
            {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {"word": "x"}},
        ],
        "stop_reason": "tool_use",
        "stop_sequence": None,
        "usage": {"input_tokens": 5, "output_tokens": 3},
        "token_ids": IDS,
        "token_logprobs": LOGPROBS,
    }


def _sse(events: list[dict[str, Any]], *, done: bool, named: bool = False) -> bytes:
    lines = [(f"event: {e['type']}\n" if named else "") + f"data: {json.dumps(e)}\n\n" for e in events]
    return ("".join(lines) + ("data: [DONE]\n\n" if done else "")).encode()


def _stream(path: str, body: dict[str, Any]) -> bytes:
    if path.endswith("/chat/completions"):
        full = _chat(body)
        choice = full["choices"][0]
        base = {k: full[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
        chunks = [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": "answer"},
                "token_ids": IDS[:1],
                "token_logprobs": LOGPROBS[:1],
                "finish_reason": None,
            },
            {
                "index": 0,
                "delta": {"content": choice["message"]["content"].removeprefix("answer")},
                "token_ids": IDS[1:],
                "token_logprobs": LOGPROBS[1:],
                "finish_reason": "stop",
            },
        ]
        return _sse([{**base, "choices": [c]} for c in chunks], done=True)
    if path.endswith("/completions"):
        base = {"id": "t1", "object": "text_completion", "created": 0, "model": "agent@3"}
        chunks = [
            {
                "index": 0,
                "text": " do",
                "token_ids": IDS[:1],
                "token_logprobs": LOGPROBS[:1],
                "prompt_token_ids": [1, 2],
                "finish_reason": None,
                "logprobs": None,
            },
            {
                "index": 0,
                "text": "ne",
                "token_ids": IDS[1:],
                "token_logprobs": LOGPROBS[1:],
                "finish_reason": "stop",
                "logprobs": None,
            },
        ]
        return _sse([{**base, "choices": [c]} for c in chunks], done=True)
    if path.endswith("/responses"):
        full = _response(body)
        started = {**full, "status": "in_progress", "output": []}
        started.pop("token_ids"), started.pop("token_logprobs")
        events = [
            {"type": "response.created", "sequence_number": 0, "response": started},
            {
                "type": "response.output_text.delta",
                "sequence_number": 1,
                "item_id": "m1",
                "output_index": 0,
                "content_index": 0,
                "delta": "thinking",
                "logprobs": [],
            },
            {"type": "response.completed", "sequence_number": 2, "response": full},
        ]
        return _sse(events, done=False, named=True)
    full = _message(body)
    start = {k: v for k, v in full.items() if k not in ("token_ids", "token_logprobs")}
    events = [
        {"type": "message_start", "message": {**start, "content": [], "stop_reason": None}},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "let me look"}},
        {"type": "content_block_stop", "index": 0},
        {
            "type": "content_block_start",
            "index": 1,
            "content_block": {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {}},
        },
        {
            "type": "content_block_delta",
            "index": 1,
            "delta": {"type": "input_json_delta", "partial_json": '{"word": '},
        },
        {
            "type": "content_block_delta",
            "index": 1,
            "delta": {"type": "input_json_delta", "partial_json": '"x"}'},
        },
        {"type": "content_block_stop", "index": 1},
        {
            "type": "message_delta",
            "delta": {"stop_reason": "tool_use", "stop_sequence": None},
            "usage": {"output_tokens": 3},
            "token_ids": IDS,
            "token_logprobs": LOGPROBS,
        },
        {"type": "message_stop"},
    ]
    return _sse(events, done=False, named=True)


ANSWERS = {
    "/v1/chat/completions": _chat,
    "/v1/completions": _completion,
    "/v1/responses": _response,
    "/v1/messages": _message,
}


async def _handle(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    if body.get("model") == "missing":
        return web.json_response({"error": {"message": "no such model"}}, status=404)
    if not body.get("stream"):
        return web.json_response(ANSWERS[request.path](body))
    response = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await response.prepare(request)
    data = _stream(request.path, body)
    for i in range(0, len(data), 50):  # in pieces, as a server streams
        await response.write(data[i : i + 50])
    await response.write_eof()
    return response


@pytest.fixture
async def endpoint() -> AsyncIterator[str]:
    app = web.Application()
    for path in ANSWERS:
        app.router.add_post(path, _handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


# --------------------------------------------------------------------------- the official clients


async def _every_api(base: str, *, stream: bool) -> None:
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="k")
    claude = anthropic.AsyncAnthropic(base_url=base, api_key="k")
    messages: list[Any] = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": TOOL}]
    if stream:
        async for _ in await client.chat.completions.create(
            model="agent", messages=messages, tools=tools, stream=True
        ):
            pass
        async for _ in await client.completions.create(model="agent", prompt="Once", stream=True):
            pass
        async for _ in await client.responses.create(model="agent", input="hi", stream=True):
            pass
        async with claude.messages.stream(model="agent", max_tokens=8, messages=messages) as events:
            await events.get_final_message()
    else:
        await client.chat.completions.create(model="agent", messages=messages, tools=tools)
        await client.completions.create(model="agent", prompt="Once")
        await client.responses.create(
            model="agent", instructions="Be brief.", input="hi", tools=[{"type": "function", **TOOL}]
        )
        await claude.messages.create(model="agent", max_tokens=8, system="Be brief.", messages=messages)
    await client.close()
    await claude.close()


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
async def test_the_official_clients_calls_are_exchanges_with_native_responses(endpoint, stream):
    trajectory = await art.trajectory(_every_api(endpoint, stream=stream))
    exchanges = trajectory.exchanges
    assert [
        len(exchanges.chat_completions),
        len(exchanges.completions),
        len(exchanges.responses),
        len(exchanges.messages),
    ] == [1, 1, 1, 1]
    (chat,) = exchanges.chat_completions
    assert isinstance(chat.response, openai.types.chat.ChatCompletion)
    assert chat.response.choices[0].message.content == "answer 1"
    assert chat.request["messages"] == [{"role": "user", "content": "hi"}] and chat.model == "agent@3"
    assert chat.start_time <= chat.end_time
    (completion,) = exchanges.completions
    assert isinstance(completion.response, openai.types.Completion)
    assert completion.response.choices[0].text == " done"
    (response,) = exchanges.responses
    assert isinstance(response.response, openai.types.responses.Response)
    assert response.response.output_text == "thinking"
    (message,) = exchanges.messages
    assert isinstance(message.response, anthropic.types.Message)
    assert message.response.content[1].type == "tool_use" and message.response.content[1].input == {
        "word": "x"
    }
    assert trajectory.initial_policy_version == 3 and trajectory.final_policy_version == 4

    # Each exchange is a conversation ending in a sampled assistant turn, as a chat completion.
    wire = trajectory.to_wire()
    histories = [wire, *wire.additional_histories]
    assert len(histories) == 4
    for history in histories:
        answer = history.messages[-1]
        assert answer.role == "assistant" and answer.sample is not None
        assert answer.sample.token_ids == IDS and answer.sample.logprobs == LOGPROBS
        assert answer.sample.served_model in ("agent@3", "agent@4")
    by_last = {h.messages[-1].content: h for h in histories}
    assert [m.content for m in by_last[" done"].messages] == ["Once", " done"]
    claude_turn = by_last["let me look"].messages[-1]
    assert claude_turn.tool_calls[0].function.name == "lookup"
    assert json.loads(claude_turn.tool_calls[0].function.arguments) == {"word": "x"}
    if not stream:
        assert by_last["thinking"].messages[0].role == "system"
        assert by_last["thinking"].tools[0].function.name == "lookup"
    # The step changed within the rollout: each answer says which policy sampled its tokens.
    from artery.capture.conversations import conversations

    spans = [c.messages_and_choices[-1]["policy_token_spans"] for c in conversations(exchanges)]
    assert sorted(span["policy_version"] for (span,) in spans) == [3, 3, 4, 4]
    assert all(span["start_token"] == 0 and span["end_token"] == len(IDS) for (span,) in spans)


async def test_a_conversation_continued_over_the_messages_api_is_one_history(endpoint):
    async def agent() -> None:
        claude = anthropic.AsyncAnthropic(base_url=endpoint, api_key="k")
        messages: list[Any] = [{"role": "user", "content": "look x up"}]
        first = await claude.messages.create(model="agent", max_tokens=8, messages=messages)
        messages += [
            {"role": "assistant", "content": [b.model_dump() for b in first.content]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "found"}],
            },
        ]
        await claude.messages.create(model="agent", max_tokens=8, messages=messages)
        art.current_trajectory(required=True).reward = 1.0
        await claude.close()

    trajectory = await art.trajectory(agent())
    wire = trajectory.to_wire()
    assert trajectory.reward == 1.0 and wire.additional_histories == []
    assert [m.role for m in wire.messages] == ["user", "assistant", "tool", "assistant"]
    assert [m.sample is not None for m in wire.messages] == [False, True, False, True]
    assert wire.messages[2].tool_call_id == "toolu_1" and wire.messages[2].content == "found"


# --------------------------------------------------------------------------- aiohttp and requests


async def test_aiohttp_calls_plain_and_streamed_are_recorded(endpoint):
    body = {"model": "agent", "messages": [{"role": "user", "content": "hi"}]}
    with art.Trajectory() as trajectory:
        async with ClientSession() as session:
            async with session.post(f"{endpoint}/v1/chat/completions", json=body) as response:
                assert (await response.json())["choices"][0]["message"]["content"] == "answer 1"
            async with session.post(f"{endpoint}/v1/messages", json={**body, "stream": True}) as response:
                lines = [line async for line in response.content]
            assert any(b"message_stop" in line for line in lines)
            async with session.post(
                f"{endpoint}/v1/chat/completions", json={**body, "model": "missing"}
            ) as response:
                assert response.status == 404
    (chat,) = trajectory.exchanges.chat_completions
    assert chat.response.choices[0].message.content == "answer 1"
    (message,) = trajectory.exchanges.messages
    assert message.response.content[0].text == "let me look"
    assert message.response.model_extra["token_ids"] == IDS
    from artery.capture import hook_aiohttp

    assert hook_aiohttp._copies == {}  # no response body is held once read


async def test_httpx_over_an_aiohttp_transport_is_recorded_once(endpoint):
    """The OpenAI client's ``DefaultAioHttpClient`` shape: httpx above, aiohttp below."""
    import httpx

    class AiohttpTransport(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            async with ClientSession() as session:
                async with session.post(str(request.url), data=request.content) as response:
                    return httpx.Response(response.status, content=await response.read())

    client = openai.AsyncOpenAI(
        base_url=f"{endpoint}/v1", api_key="k", http_client=httpx.AsyncClient(transport=AiohttpTransport())
    )
    with art.Trajectory() as trajectory:
        await client.completions.create(model="agent", prompt="Once")
    await client.close()
    assert len(trajectory.exchanges) == 1 and len(trajectory.exchanges.completions) == 1


async def test_requests_calls_plain_and_streamed_are_recorded_from_a_thread(endpoint):
    def agent() -> str:
        body = {"model": "agent", "prompt": "Once"}
        plain = requests.post(f"{endpoint}/v1/completions", json=body, timeout=10).json()
        with requests.post(
            f"{endpoint}/v1/responses",
            json={"model": "agent", "input": "hi", "stream": True},
            stream=True,
            timeout=10,
        ) as streamed:
            events = list(streamed.iter_lines())
        assert any(b"response.completed" in e for e in events)
        return plain["choices"][0]["text"]

    with art.Trajectory() as trajectory:
        assert await asyncio.to_thread(agent) == " done"
    (completion,) = trajectory.exchanges.completions
    assert completion.response.choices[0].model_extra["prompt_token_ids"] == [1, 2]
    (response,) = trajectory.exchanges.responses
    assert response.response.output[1].type == "function_call"


# --------------------------------------------------------------------------- scopes


async def test_scopes_nest_follow_tasks_and_stop_under_no_capture(endpoint):
    client = openai.AsyncOpenAI(base_url=f"{endpoint}/v1", api_key="k")
    messages = [{"role": "user", "content": "hi"}]
    assert art.current_trajectory() is None
    with pytest.raises(RuntimeError):
        art.current_trajectory(required=True)
    with art.Trajectory() as outer:
        assert art.current_trajectory() is outer
        await asyncio.create_task(client.chat.completions.create(model="agent", messages=messages))
        with art.no_capture():  # hides the scopes around it, not the ones opened inside
            assert art.current_trajectory() is None
            await client.chat.completions.create(model="agent", messages=messages)
            with art.Trajectory() as inner:
                assert art.current_trajectory(require=True) is inner
                await client.completions.create(model="agent", prompt="x")
        assert art.current_trajectory() is outer
    await client.chat.completions.create(model="agent", messages=messages)  # outside: not recorded
    await client.close()
    assert len(outer.exchanges) == 1 and len(outer.exchanges.chat_completions) == 1
    assert len(inner.exchanges) == 1 and len(inner.exchanges.completions) == 1
    assert "duration" in outer.metrics


async def test_trajectory_group_keeps_or_raises_a_rollouts_exception(endpoint):
    async def rollout(reward: float) -> None:
        client = openai.AsyncOpenAI(base_url=f"{endpoint}/v1", api_key="k")
        await client.chat.completions.create(model="agent", messages=[{"role": "user", "content": "hi"}])
        await client.close()
        if reward < 0:
            raise ValueError("the agent failed")
        art.current_trajectory(required=True).reward = reward

    group = await art.trajectory_group([rollout(0.0), rollout(1.0), rollout(-1)], return_exceptions=True)
    assert sorted(t.reward for t in group.trajectories) == [0.0, 1.0]
    assert [e.type for e in group.exceptions] == ["ValueError"]
    assert all(len(t.exchanges.chat_completions) == 1 for t in group.trajectories)
    with pytest.raises(ValueError, match="the agent failed"):
        await art.trajectory_group([rollout(1.0), rollout(-1)])

    # ART's own form: trajectories made by ``art.trajectory``, beside ready ones, in a gather
    ready = art.Trajectory(messages_and_choices=[{"role": "user", "content": "hi"}], reward=0.5)
    [gathered] = await art.gather_trajectory_groups(
        [
            art.trajectory_group(
                [ready, art.trajectory(rollout(1.0)), art.trajectory(rollout(-1))], metadata={"k": 1}
            )
        ],
        max_exceptions=1,
    )
    assert [t.reward for t in gathered.trajectories] == [0.5, 1.0] and gathered.metadata == {"k": 1}
    assert len(gathered.trajectories[1].exchanges) == 1 and [e.type for e in gathered.exceptions] == [
        "ValueError"
    ]


# --------------------------------------------------------------------------- group scopes


async def _rollout(endpoint: str, reward: float, turn: asyncio.Event | None = None) -> None:
    """One chat call; then, given a turn, it waits for it (so the test decides the order the
    rollouts end in); a negative reward is a failed rollout."""
    client = openai.AsyncOpenAI(base_url=f"{endpoint}/v1", api_key="k")
    await client.chat.completions.create(model="agent", messages=[{"role": "user", "content": "hi"}])
    await client.close()
    if turn is not None:
        await turn.wait()
    if reward < 0:
        raise ValueError("the agent failed")
    art.current_trajectory(required=True).reward = reward


async def test_a_group_scope_collects_concurrent_rollouts_in_completion_order(endpoint):
    assert art.current_trajectory_group() is None
    with pytest.raises(RuntimeError, match="TrajectoryGroup"):
        art.current_trajectory_group(required=True)
    turns = [asyncio.Event() for _ in range(4)]
    with art.TrajectoryGroup() as group:
        assert art.current_trajectory_group(require=True) is group
        rewards = (0.0, 0.5, 1.0, -1)
        tasks = [
            asyncio.create_task(art.trajectory(_rollout(endpoint, r, t)))
            for r, t in zip(rewards, turns, strict=True)
        ]
        for i in (2, 0, 3, 1):  # each ends (in its own task) only once the one before has
            turns[i].set()
            await asyncio.gather(tasks[i], return_exceptions=True)

        def in_a_thread() -> None:
            with art.Trajectory() as threaded:
                body = {"model": "agent", "prompt": "x"}
                requests.post(f"{endpoint}/v1/completions", json=body, timeout=10)
                threaded.reward = 0.25

        await asyncio.to_thread(in_a_thread)
    with art.Trajectory():  # ends after the scope: not the group's
        pass
    assert art.current_trajectory_group() is None
    assert [t.reward for t in group.trajectories] == [1.0, 0.0, 0.5, 0.25]
    assert [t.exchanges.chat_completions[0].model for t in group.trajectories[:3]] == ["agent@3"] * 3
    assert len(group.trajectories[3].exchanges.completions) == 1
    assert [(e.type, e.message) for e in group.exceptions] == [("ValueError", "the agent failed")]


async def test_group_scopes_nest_and_collect_what_trajectory_group_runs(endpoint):
    with art.TrajectoryGroup() as outer:
        with art.TrajectoryGroup() as inner:
            assert art.current_trajectory_group() is inner
            first = await art.trajectory(_rollout(endpoint, 1.0))
        assert art.current_trajectory_group() is outer
        second = await art.trajectory(_rollout(endpoint, 0.5))
        # As in ART, the rollouts of a group awaited inside end inside: the scope keeps them too,
        # and a failure once, whether the rollout had a scope of its own or not.
        returned = await art.trajectory_group(
            [
                _rollout(endpoint, 0.0),
                art.trajectory(_rollout(endpoint, 0.25)),
                art.trajectory(_rollout(endpoint, -1)),
            ],
            return_exceptions=True,
        )
    assert inner.trajectories == [first] and outer.trajectories[0] is second
    assert sorted(t.reward for t in returned.trajectories) == [0.0, 0.25]
    assert {id(t) for t in outer.trajectories[1:]} == {id(t) for t in returned.trajectories}
    assert len(outer.trajectories) == 3 and all(len(t.exchanges) == 1 for t in outer.trajectories)
    assert [e.type for e in outer.exceptions] == [e.type for e in returned.exceptions] == ["ValueError"]


async def test_a_group_of_awaitables_still_works_and_warns_once(endpoint, monkeypatch):
    import warnings

    monkeypatch.setattr("artery.trajectories._warned", False)
    with pytest.warns(DeprecationWarning, match=r"await art\.trajectory_group\(\.\.\.\)"):
        group = await art.TrajectoryGroup(art.trajectory(_rollout(endpoint, r)) for r in (0.0, 1.0))
    assert sorted(t.reward for t in group.trajectories) == [0.0, 1.0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = await art.TrajectoryGroup([art.trajectory(_rollout(endpoint, 0.5))])
    assert [t.reward for t in again.trajectories] == [0.5]
    assert not [w for w in caught if issubclass(w.category, DeprecationWarning)]


def test_a_trajectory_holds_exchanges_or_messages_not_both():
    from artery.capture.exchanges import Exchange

    trajectory = art.Trajectory(messages_and_choices=[{"role": "user", "content": "hi"}])
    now = trajectory.start_time
    trajectory.record_exchange(
        "chat_completions", Exchange({"messages": []}, _chat({"messages": []}), None, now, now)
    )
    with pytest.raises(ValueError, match="not both"):
        trajectory.to_wire()


async def test_the_old_names_warn_once_and_still_capture(endpoint):
    import sys

    sys.modules["artery.auto_trajectory"]._warned.clear()
    with pytest.warns(DeprecationWarning, match="art.trajectory"):
        captured = await art.capture_auto_trajectory(asyncio.sleep(0))
    assert isinstance(captured, art.Trajectory)
    with art.Trajectory() as scoped, pytest.warns(DeprecationWarning, match="current_trajectory"):
        assert art.auto_trajectory() is scoped


# --------------------------------------------------------------------------- the real service


async def _agent_on_every_api(model: art.TrainableModel, reward: float) -> None:
    """A rollout through the official clients, aiohttp and requests, as an agent would write it."""
    name, key = model.get_inference_name(), model.inference_api_key or "artery"
    base = (model.inference_base_url or "").rstrip("/")
    client = model.openai_client()
    question = [{"role": "user", "content": "Say a letter."}]
    first = await client.chat.completions.create(model=name, messages=question, max_tokens=4)
    follow_up = [*question, first.choices[0].message, {"role": "user", "content": "Another."}]
    await client.chat.completions.create(model=name, messages=follow_up, max_tokens=4)
    await client.completions.create(model=name, prompt="Once upon a", max_tokens=4)
    await client.responses.create(model=name, input="Say a letter.", max_output_tokens=4)
    claude = anthropic.AsyncAnthropic(base_url=base.removesuffix("/v1"), api_key=key)
    await claude.messages.create(model=name, max_tokens=4, messages=question)
    # the same three streamed, read to their end as the clients do
    async for _ in await client.completions.create(
        model=name, prompt="Once upon a", max_tokens=4, stream=True
    ):
        pass
    async for _ in await client.responses.create(
        model=name, input="Say a letter.", max_output_tokens=4, stream=True
    ):
        pass
    async with claude.messages.stream(model=name, max_tokens=4, messages=question) as events:
        await events.get_final_message()
    await claude.close()
    body = {"model": name, "messages": [{"role": "user", "content": "A word?"}], "max_tokens": 4}
    headers = {"Authorization": f"Bearer {key}"}
    async with ClientSession(headers=headers) as session:
        async with session.post(f"{base}/chat/completions", json=body) as response:
            response.raise_for_status()
            await response.json()
    text = {**body, "messages": [{"role": "user", "content": "A number?"}]}
    answer = await asyncio.to_thread(
        requests.post, f"{base}/chat/completions", json=text, headers=headers, timeout=120
    )
    answer.raise_for_status()
    art.current_trajectory(required=True).reward = reward


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_rollouts_captured_from_every_wire_api_train(tmp_path):
    from artery.shared.models import TINY

    backend = art.LocalBackend(path=tmp_path / "artery")
    model = art.TrainableModel(name="scopes", project="capture", base_model=TINY)
    try:
        await model.register(backend)
        group = await art.trajectory_group(_agent_on_every_api(model, r) for r in (0.0, 0.5, 1.0))
        for trajectory in group.trajectories:
            exchanges = trajectory.exchanges
            counts = [
                len(getattr(exchanges, k))
                for k in ("chat_completions", "completions", "responses", "messages")
            ]
            assert counts == [4, 2, 2, 2]
            assert all(e.model == f"{model.name}@0" for _, e in exchanges.in_order())
            wire = trajectory.to_wire()
            histories = [wire, *wire.additional_histories]
            # the continued chat is one conversation; each other call is one of its own
            assert [m.role for m in wire.messages] == ["user", "assistant", "user", "assistant"]
            assert len(histories) == 9
            for history in histories:
                sample = history.messages[-1].sample
                assert sample is not None and sample.token_ids
                assert len(sample.token_ids) == len(sample.logprobs)
        result = await model.train([group], config=art.TrainConfig(learning_rate=1e-3))
        assert result.step == 1 and result.metrics["tokens_trained"] > 0
    finally:
        await backend.close()


async def test_a_captured_trajectory_is_logged_with_its_messages(endpoint, tmp_path):
    """``model.log`` (the parquet file) and ``for_logging`` show what was captured, as they show
    the messages an agent appends itself: the exchanges rebuilt as a conversation."""
    from artery.parquet import read_trajectory_groups_parquet, write_trajectory_groups_parquet

    async def agent() -> None:
        client = openai.AsyncOpenAI(base_url=f"{endpoint}/v1", api_key="k")
        await client.chat.completions.create(model="agent@3", messages=[{"role": "user", "content": "hi"}])
        art.current_trajectory(required=True).reward = 0.5
        await client.close()

    trajectory = await art.trajectory(agent())
    logged = trajectory.for_logging()
    assert [(m["role"], m["trainable"]) for m in logged["messages"]] == [("user", False), ("assistant", True)]
    assert logged["messages"][0]["content"] == "hi"

    path = write_trajectory_groups_parquet([art.TrajectoryGroup([trajectory])], tmp_path / "0001.parquet")
    [group] = read_trajectory_groups_parquet(path)
    [read] = group.trajectories
    assert read.reward == 0.5 and len(read.messages_and_choices) == 2
    assert read.messages()[0]["content"] == "hi" and read.messages()[1]["role"] == "assistant"
