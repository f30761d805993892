"""``auto_trajectory`` / ``capture_auto_trajectory`` and ``yield_trajectory``.

Units against a fake OpenAI-compatible endpoint (``httpx.MockTransport``) answering in Artery's
shape (``token_ids`` on each choice); then one test through the real inference service with the
OpenAI client, plain ``httpx``, a stream and litellm, whose captured trajectories train a step.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

import httpx
import openai
import pytest

import artery as art
from artery.auto_trajectory import auto_trajectory, capture_auto_trajectory
from artery.yield_trajectory import capture_yielded_trajectory, yield_trajectory

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # before litellm is imported

BASE = "http://fake.test/v1"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a word up.",
            "parameters": {"type": "object", "properties": {"word": {"type": "string"}}},
        },
    }
]


# --------------------------------------------------------------------------- a fake endpoint


def _answer(body: dict[str, Any]) -> tuple[str, list[int]]:
    """A deterministic answer: its text names the number of messages it answers."""
    n = len(body["messages"])
    return f"answer {n}", [100 + n, 200 + n, 2]


def _entries(text: str, token_ids: list[int]) -> list[dict[str, Any]]:
    pieces = [*text.split(" "), ""]
    return [
        {"token": p, "logprob": -0.5 - i, "bytes": None, "top_logprobs": [], "token_id": t}
        for i, (p, t) in enumerate(zip(pieces, token_ids, strict=True))
    ]


def _completion(body: dict[str, Any]) -> dict[str, Any]:
    text, token_ids = _answer(body)
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 0,
        "model": "agent@3",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text, "refusal": None},
                "logprobs": {"content": _entries(text, token_ids)},
                "finish_reason": "stop",
                "token_ids": token_ids,
            }
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4},
        "prompt_token_ids": [1],
    }


def _stream(body: dict[str, Any]) -> bytes:
    """The same answer as server-sent events, in Artery's chunk shape; with tools, a tool call
    whose arguments arrive in two pieces."""
    text, token_ids = _answer(body)
    entries = _entries(text, token_ids)
    base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "agent@4"}
    chunks = [{"index": 0, "delta": {"role": "assistant"}, "logprobs": None, "finish_reason": None}]
    for word, entry, token_id in zip(text.split(" "), entries, token_ids, strict=False):
        chunks.append(
            {
                "index": 0,
                "delta": {"content": word if word == "answer" else f" {word}"},
                "logprobs": {"content": [entry]},
                "finish_reason": None,
                "token_ids": [token_id],
            }
        )
    if body.get("tools"):
        call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "lookup"}}
        chunks.append(
            {
                "index": 0,
                "delta": {"tool_calls": [{**call, "function": {"name": "lookup", "arguments": '{"wo'}}]},
            }
        )
        chunks.append(
            {"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": 'rd": "x"}'}}]}}
        )
    chunks.append(
        {
            "index": 0,
            "delta": {},
            "logprobs": {"content": [entries[-1]]},
            "finish_reason": "tool_calls" if body.get("tools") else "stop",
            "token_ids": [token_ids[-1]],
        }
    )
    lines = [f"data: {json.dumps({**base, 'choices': [c]})}\n\n" for c in chunks]
    return ("".join(lines) + "data: [DONE]\n\n").encode()


def _handler(request: httpx.Request) -> httpx.Response:
    if not request.url.path.endswith("/chat/completions"):
        return httpx.Response(200, json={"object": "list", "data": []})
    body = json.loads(request.content)
    if body.get("model") == "missing":
        return httpx.Response(404, json={"error": {"message": "no such model", "type": "not_found"}})
    if body.get("stream"):  # in pieces of 7 bytes, read only when the client reads it
        return httpx.Response(
            200, content=_pieces(_stream(body)), headers={"content-type": "text/event-stream"}
        )
    return httpx.Response(200, json=_completion(body))


async def _pieces(data: bytes):
    for i in range(0, len(data), 7):
        yield data[i : i + 7]


def _client() -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=BASE, transport=httpx.MockTransport(_handler))


async def _post(client: httpx.AsyncClient, messages: list[Any], **extra: Any) -> dict[str, Any]:
    response = await client.post("/chat/completions", json={"model": "agent", "messages": messages, **extra})
    response.raise_for_status()
    return response.json()["choices"][0]


def _samples(items: list[Any]) -> list[list[int]]:
    return [
        m.sample.token_ids for m in art.Trajectory(messages_and_choices=items).to_wire().messages if m.sample
    ]


# --------------------------------------------------------------------------- units


def test_auto_trajectory_is_none_outside_a_capture_or_raises_when_required():
    assert auto_trajectory() is None
    with pytest.raises(RuntimeError, match="capture_auto_trajectory"):
        auto_trajectory(required=True)


async def test_a_continued_conversation_is_recorded_once_with_its_samples_and_reward():
    async def agent(client: httpx.AsyncClient) -> str:
        messages: list[Any] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
        first = await _post(client, messages, tools=TOOLS, logprobs=True)
        # Sent back as an OpenAI client would: with the fields the response had (refusal: null).
        messages += [first["message"], {"role": "user", "content": "and then?"}]
        second = await _post(client, messages, tools=TOOLS, logprobs=True)
        trajectory = auto_trajectory(required=True)
        trajectory.reward = 0.75
        trajectory.metadata["last"] = second["message"]["content"]
        return "ignored"

    async with _client() as client:
        trajectory = await capture_auto_trajectory(agent(client))

    assert auto_trajectory() is None  # the capture is over
    items = trajectory.messages_and_choices
    assert [m["role"] for m in trajectory.messages()] == ["system", "user", "assistant", "user", "assistant"]
    assert all(isinstance(items[i], openai.types.chat.chat_completion.Choice) for i in (2, 4))
    assert items[2].model_extra["token_ids"] == [102, 202, 2] and items[4].model_extra["token_ids"] == [
        104,
        204,
        2,
    ]
    wire = trajectory.to_wire()
    assert [m.sample.token_ids for m in wire.messages if m.sample] == [[102, 202, 2], [104, 204, 2]]
    assert wire.messages[4].sample.logprobs == [-0.5, -1.5, -2.5]
    assert wire.tools is not None and wire.tools[0].function.name == "lookup"
    assert trajectory.tools == TOOLS
    assert trajectory.additional_histories == []
    assert trajectory.reward == 0.75 and trajectory.metadata == {"last": "answer 4"}
    assert trajectory.initial_policy_version == 3 and trajectory.final_policy_version == 3
    assert trajectory.metrics["duration"] >= 0


async def test_branches_become_additional_histories_and_the_longest_conversation_wins():
    async def agent(client: httpx.AsyncClient) -> None:
        # A sub-agent's single call comes first; the main conversation then runs two turns.
        await _post(client, [{"role": "user", "content": "summarise this"}])
        messages: list[Any] = [{"role": "user", "content": "hi"}]
        first = await _post(client, messages, tools=TOOLS)
        messages += [first["message"], {"role": "user", "content": "more"}]
        await _post(client, messages, tools=TOOLS)
        # The same prompt again (a second sample): a branch, not a continuation.
        await _post(client, [{"role": "user", "content": "hi"}], tools=TOOLS)

    async with _client() as client:
        trajectory = await capture_auto_trajectory(agent(client))

    assert [m["content"] for m in trajectory.messages()] == ["hi", "answer 1", "more", "answer 3"]
    assert trajectory.tools == TOOLS
    histories = [(h.messages_and_choices, h.tools) for h in trajectory.additional_histories]
    assert len(histories) == 2
    assert histories[0][0][0] == {"role": "user", "content": "summarise this"} and histories[0][1] is None
    assert histories[1][0][0] == {"role": "user", "content": "hi"} and histories[1][1] == TOOLS
    wire = trajectory.to_wire()
    assert [[m.sample.token_ids for m in h.messages if m.sample] for h in wire.additional_histories] == [
        [[101, 201, 2]],
        [[101, 201, 2]],
    ]


async def test_openai_client_streams_and_httpx2_clients_are_captured():
    import httpx2

    async def agent() -> None:
        legacy = openai.AsyncOpenAI(base_url=BASE, api_key="x", http_client=_client())
        messages: list[Any] = [{"role": "user", "content": "hi"}]
        stream = await legacy.chat.completions.create(
            model="agent", messages=messages, tools=TOOLS, logprobs=True, stream=True
        )
        text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
        assert text == "answer 1"
        # openai's own default transport is httpx2, a fork with classes of its own.
        modern = openai.AsyncOpenAI(
            base_url=BASE,
            api_key="x",
            http_client=httpx2.AsyncClient(transport=httpx2.MockTransport(_handler2)),
        )
        call = {
            "id": "call_1",
            "type": "function",
            "function": {"name": "lookup", "arguments": '{"word": "x"}'},
        }
        messages += [
            {"role": "assistant", "content": "answer 1", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "x: a letter"},
        ]
        await modern.chat.completions.create(model="agent", messages=messages, tools=TOOLS, logprobs=True)

    trajectory = await capture_auto_trajectory(agent())

    assert [m["role"] for m in trajectory.messages()] == ["user", "assistant", "tool", "assistant"]
    assert trajectory.additional_histories == []
    streamed = trajectory.to_wire().messages[1]
    assert streamed.content == "answer 1"
    assert (
        streamed.tool_calls[0].function.arguments == '{"word": "x"}' and streamed.tool_calls[0].id == "call_1"
    )
    assert streamed.sample.token_ids == [101, 201, 2] and streamed.sample.logprobs == [-0.5, -1.5, -2.5]
    assert streamed.sample.finish_reason == "tool_calls"
    assert _samples(trajectory.messages_and_choices)[1] == [103, 203, 2]
    assert (trajectory.initial_policy_version, trajectory.final_policy_version) == (4, 3)


def _handler2(request: Any) -> Any:
    """``_handler`` for httpx2's classes."""
    import httpx2

    response = _handler(httpx.Request(request.method, str(request.url), content=request.content))
    return httpx2.Response(response.status_code, content=response.content, headers=dict(response.headers))


async def test_a_sync_client_in_a_thread_and_a_stream_read_line_by_line_are_captured():
    def sync_call() -> None:
        with httpx.Client(base_url=BASE, transport=httpx.MockTransport(_handler)) as client:
            client.post(
                "/chat/completions", json={"model": "agent", "messages": [{"role": "user", "content": "a"}]}
            )

    async def agent() -> None:
        await asyncio.to_thread(sync_call)
        async with _client() as client:
            body = {"model": "agent", "messages": [{"role": "user", "content": "b"}], "stream": True}
            async with client.stream("POST", "/chat/completions", json=body) as response:
                assert [line async for line in response.aiter_lines() if line][-1] == "data: [DONE]"
            # A stream left unread is not recorded (its answer was never seen).
            async with client.stream("POST", "/chat/completions", json=body):
                pass

    trajectory = await capture_auto_trajectory(agent())
    assert trajectory.messages()[0]["content"] == "a"
    assert [h.messages_and_choices[0]["content"] for h in trajectory.additional_histories] == ["b"]
    assert _samples(trajectory.additional_histories[0].messages_and_choices) == [[101, 201, 2]]


async def test_other_requests_errors_and_requests_outside_the_capture_are_left_alone():
    started, release = asyncio.Event(), asyncio.Event()

    async def agent(client: httpx.AsyncClient) -> None:
        await client.get("/models")
        with pytest.raises(httpx.HTTPStatusError):
            await _post(client, [{"role": "user", "content": "x"}] * 2, model="missing")
        started.set()
        await release.wait()
        await _post(client, [{"role": "user", "content": "inside"}])

    async def outsider(client: httpx.AsyncClient) -> None:  # another task, outside the capture
        await started.wait()
        body = {"model": "agent", "messages": [{"role": "user", "content": "out"}], "stream": True}
        async with client.stream("POST", "/chat/completions", json=body) as response:
            assert "aiter_bytes" not in vars(response)  # untouched
            await response.aread()
        release.set()

    async with _client() as client:
        trajectory, _ = await asyncio.gather(capture_auto_trajectory(agent(client)), outsider(client))
    assert [m["content"] for m in trajectory.messages()] == ["inside", "answer 1"]
    assert trajectory.additional_histories == []


async def test_an_agent_that_raises_leaves_no_capture_behind():
    async def agent() -> None:
        auto_trajectory(required=True).reward = 1
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        await capture_auto_trajectory(agent())
    assert auto_trajectory() is None


async def test_yield_trajectory_hands_the_last_trajectory_out():
    async def agent() -> int:
        yield_trajectory(art.Trajectory(reward=0.1))
        await asyncio.sleep(0)
        yield_trajectory(art.Trajectory(messages_and_choices=[{"role": "user", "content": "x"}], reward=0.9))
        return 7

    trajectory = await capture_yielded_trajectory(agent())
    assert trajectory.reward == 0.9 and trajectory.messages() == [{"role": "user", "content": "x"}]
    yield_trajectory(art.Trajectory())  # outside a capture: nothing happens

    async def silent() -> None:
        pass

    with pytest.raises(RuntimeError, match="No trajectory yielded"):
        await capture_yielded_trajectory(silent())

    # Concurrent captures each get their own.
    async def tagged(reward: float) -> None:
        await asyncio.sleep(0.01 * (1 - reward))
        yield_trajectory(art.Trajectory(reward=reward))

    results = await asyncio.gather(*(capture_yielded_trajectory(tagged(r)) for r in (0.0, 0.5, 1.0)))
    assert [t.reward for t in results] == [0.0, 0.5, 1.0]


# --------------------------------------------------------------------------- the real service


async def _openai_agent(model: art.TrainableModel, reward: float, *, stream: bool = False) -> None:
    client = model.openai_client()
    messages: list[Any] = [{"role": "user", "content": "Say a letter."}]
    params: dict[str, Any] = {
        "model": model.get_inference_name(),
        "tools": TOOLS,
        "max_tokens": 4,
        "logprobs": True,
    }
    if stream:
        chunks = await client.chat.completions.create(messages=messages, stream=True, **params)
        text = "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
        messages.append({"role": "assistant", "content": text})
    else:
        first = await client.chat.completions.create(messages=messages, **params)
        messages.append(first.choices[0].message)  # the message object itself, as ART's agents do
    messages.append({"role": "user", "content": "Another one."})
    await client.chat.completions.create(messages=messages, **params)
    auto_trajectory(required=True).reward = reward


async def _httpx_agent(model: art.TrainableModel, reward: float) -> None:
    headers = {"Authorization": f"Bearer {model.inference_api_key or 'artery'}"}
    async with httpx.AsyncClient(base_url=model.inference_base_url, headers=headers, timeout=60) as client:
        messages: list[Any] = [{"role": "user", "content": "Say a letter."}]
        body = {"model": model.name, "tools": TOOLS, "max_tokens": 4, "logprobs": True}
        for turn in range(2):
            response = await client.post("/chat/completions", json={**body, "messages": messages})
            response.raise_for_status()
            messages += [
                response.json()["choices"][0]["message"],
                {"role": "user", "content": f"More {turn}."},
            ]
    auto_trajectory(required=True).reward = reward


async def _litellm_agent(model: art.TrainableModel, reward: float) -> None:
    import litellm

    messages: list[Any] = [{"role": "user", "content": "Say a letter."}]
    params = {**model.litellm_completion_params(), "tools": TOOLS, "max_tokens": 4, "logprobs": True}
    first = await litellm.acompletion(messages=messages, **params)
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "user", "content": "Again."},
    ]
    await litellm.acompletion(messages=messages, **params)
    auto_trajectory(required=True).reward = reward


def _check_two_turns(trajectory: art.Trajectory, label: str) -> None:
    wire = trajectory.to_wire()
    assert [m.role for m in wire.messages] == ["user", "assistant", "user", "assistant"], label
    assert wire.additional_histories == [], label
    assert wire.tools is not None and wire.tools[0].function.name == "lookup", label
    for message in (wire.messages[1], wire.messages[3]):
        assert message.sample is not None, label
        assert message.sample.token_ids and len(message.sample.token_ids) == len(message.sample.logprobs), (
            label
        )
    assert trajectory.initial_policy_version == 0 and trajectory.final_policy_version == 0, label


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_captured_rollouts_from_every_client_keep_their_tokens_and_train(tmp_path):
    from artery.shared.models import TINY

    backend = art.LocalBackend(path=tmp_path / "artery")
    model = art.TrainableModel(name="auto", project="capture", base_model=TINY)
    try:
        await model.register(backend)
        agents = {
            "openai": lambda r: _openai_agent(model, r),
            "openai stream": lambda r: _openai_agent(model, r, stream=True),
            "httpx": lambda r: _httpx_agent(model, r),
            "litellm": lambda r: _litellm_agent(model, r),
        }
        groups = []
        for label, agent in agents.items():
            trajectories = await asyncio.gather(*(capture_auto_trajectory(agent(r)) for r in (0.0, 1.0)))
            for trajectory in trajectories:
                _check_two_turns(trajectory, label)
            assert [t.reward for t in trajectories] == [0.0, 1.0]
            groups.append(art.TrajectoryGroup(trajectories))
        result = await model.train(groups, config=art.TrainConfig(learning_rate=1e-3))
        assert result.step == 1
        assert await model.get_step() == 1
    finally:
        await backend.close()
