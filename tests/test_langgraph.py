"""``artery.langgraph``: a LangGraph ReAct agent's rollout becomes a Trajectory with its samples.

- against a scripted OpenAI-compatible server that answers a tool call first: the tool message
  lands in the conversation, every assistant turn keeps its token ids and logprobs, a second
  conversation in the same rollout becomes an additional history;
- against Artery's own inference service with the tiny model: the captured trajectories carry the
  engine's token ids, and one training step runs on them.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

pytest.importorskip("langgraph", reason="the langgraph extra: pip install -e '.[langgraph]'")
from fastapi import FastAPI, Request
from langchain_core.messages import HumanMessage, SystemMessage
from langchain_core.tools import tool
from langgraph.prebuilt import create_react_agent

import artery as art
from artery import convert
from artery.langgraph import init_chat_model, wrap_rollout

# ART's examples use langgraph.prebuilt's create_react_agent, deprecated (not gone) in LangGraph 1.x.
pytestmark = pytest.mark.filterwarnings("ignore:create_react_agent has been moved")


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@tool
def shout(text: str) -> str:
    """Return the text in capitals."""
    return text.upper()


# --------------------------------------------------------------------------- scripted server


class ScriptedChat:
    """Answers ``/v1/chat/completions`` from a script of messages, in order, each with made-up
    token ids and logprobs in Artery's shape (``token_ids`` on the choice, ``token_id`` per entry)."""

    def __init__(self, script: list[dict]) -> None:
        self.script = list(script)
        self.requests: list[dict] = []
        self.url = ""
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            body = await request.json()
            self.requests.append(body)
            n = len(self.requests)
            message = self.script.pop(0)
            token_ids = [100 * n + i for i in range(3)]
            return {
                "id": f"chatcmpl-{n}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": "agent@3",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", **message},
                        "finish_reason": "tool_calls" if message.get("tool_calls") else "stop",
                        "logprobs": {
                            "content": [
                                {
                                    "token": f"t{t}",
                                    "token_id": t,
                                    "logprob": -0.5,
                                    "bytes": None,
                                    "top_logprobs": [],
                                }
                                for t in token_ids
                            ]
                        },
                        "token_ids": token_ids,
                    }
                ],
                "usage": {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13},
            }

        self.app = app


@contextmanager
def serve(script: list[dict]) -> Iterator[ScriptedChat]:
    import uvicorn

    server_app = ScriptedChat(script)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(server_app.app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "the scripted server did not start"
        time.sleep(0.02)
    server_app.url = f"http://127.0.0.1:{port}"
    try:
        yield server_app
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def tool_call(call_id: str, name: str, arguments: dict) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def as_dicts(items) -> list[dict]:
    import msgspec

    return [msgspec.to_builtins(convert.to_message(m)) for m in items]


async def test_a_react_agent_with_a_tool_call_becomes_a_trajectory_with_every_sample():
    script = [
        {"content": None, "tool_calls": [tool_call("call_1", "add", {"a": 2, "b": 3})]},
        {"content": "2 + 3 = 5"},
        {"content": "Five."},  # a second conversation: a summary with its own prompt
    ]
    with serve(script) as server:
        model = art.Model(
            name="agent", project="lg", inference_base_url=server.url + "/v1", inference_api_key="k"
        )

        async def rollout(question: str) -> art.Trajectory:
            chat = init_chat_model(max_tokens=32)
            agent = create_react_agent(chat, [add, shout])
            result = await agent.ainvoke({"messages": [HumanMessage(question)]})
            answer = result["messages"][-1].content
            summary = await chat.ainvoke([SystemMessage("Summarise in one word."), HumanMessage(answer)])
            trajectory = art.Trajectory(reward=1.0 if "5" in answer else 0.0, metadata={"q": question})
            trajectory.metrics["summary_chars"] = len(summary.content)
            return trajectory

        trajectory = await wrap_rollout(model, rollout)("What is 2 + 3?")
        await model.openai_client().close()

    # The request the agent sent after the tool ran: the tool's answer is in it.
    second = server.requests[1]["messages"]
    assert [m["role"] for m in second] == ["user", "assistant", "tool"]
    assert second[2] == {"role": "tool", "content": "5", "tool_call_id": "call_1"}
    assert server.requests[0]["logprobs"] is True and server.requests[0]["temperature"] == 1.0
    assert server.requests[0].get("max_completion_tokens", server.requests[0].get("max_tokens")) == 32
    assert {t["function"]["name"] for t in server.requests[0]["tools"]} == {"add", "shout"}

    # The longest conversation is the trajectory's own, with the tools and every sample.
    assert trajectory.reward == 1.0 and trajectory.metadata == {"q": "What is 2 + 3?"}
    assert trajectory.metrics["summary_chars"] == len("Five.")
    messages = as_dicts(trajectory.messages_and_choices)
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
    assert messages[1]["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 2, "b": 3}'}
    assert messages[2]["content"] == "5" and messages[2]["tool_call_id"] == "call_1"
    assert messages[1]["sample"]["token_ids"] == [100, 101, 102]
    assert messages[1]["sample"]["logprobs"] == [-0.5] * 3
    assert messages[3]["sample"]["token_ids"] == [200, 201, 202]
    assert messages[3]["content"] == "2 + 3 = 5"
    assert {t["function"]["name"] for t in trajectory.tools} == {"add", "shout"}
    assert trajectory.initial_policy_version == 3 and trajectory.final_policy_version == 3

    # The summary's conversation is a branch, with its own sample.
    assert len(trajectory.additional_histories) == 1
    branch = as_dicts(trajectory.additional_histories[0].messages_and_choices)
    assert [m["role"] for m in branch] == ["system", "user", "assistant"]
    assert branch[2]["sample"]["token_ids"] == [300, 301, 302]


async def test_structured_output_and_a_rollout_returning_none_and_outside_a_rollout():
    from pydantic import BaseModel

    class Verdict(BaseModel):
        value: int

    with pytest.raises(RuntimeError, match="wrap_rollout"):
        init_chat_model()
    with serve([{"content": None, "tool_calls": [tool_call("c1", "Verdict", {"value": 5})]}]) as server:
        model = art.Model(name="agent", project="lg", inference_base_url=server.url + "/v1")
        verdicts = []

        async def rollout() -> None:
            verdicts.append(await init_chat_model().with_structured_output(Verdict).ainvoke("2 + 3?"))

        trajectory = await wrap_rollout(model, rollout)()
        await model.openai_client().close()
    assert verdicts == [Verdict(value=5)]  # as ART: the tool call's arguments, validated
    messages = as_dicts(trajectory.messages_and_choices)
    assert [m["role"] for m in messages] == ["user", "assistant"]
    assert messages[1]["sample"]["token_ids"] == [100, 101, 102]
    assert [t["function"]["name"] for t in trajectory.tools] == ["Verdict"]


def test_without_the_extra_the_import_error_names_it():
    code = (
        "import sys; sys.modules['langchain_openai'] = None\n"
        "try:\n    import artery.langgraph\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "pip install 'artery[langgraph]'" in out.stdout, out.stdout + out.stderr


# --------------------------------------------------------------------------- real services


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_a_langgraph_agent_on_artery_inference_keeps_the_engines_tokens_and_trains(tmp_path):
    from artery.shared.models import TINY

    backend = art.LocalBackend(path=tmp_path / "artery")
    model = art.TrainableModel(name="graph", project="langgraph", base_model=TINY)
    try:
        await model.register(backend)

        async def rollout(index: int) -> art.Trajectory:
            agent = create_react_agent(init_chat_model(max_tokens=6), [add, shout])
            await agent.ainvoke({"messages": [HumanMessage("Add 2 and 3.")]}, {"recursion_limit": 6})
            # The tiny random model writes no real tool call: the rewards only have to differ.
            return art.Trajectory(reward=index / 3, metadata={"index": index})

        groups = await art.gather_trajectory_groups(
            [art.TrajectoryGroup(wrap_rollout(model, rollout)(i) for i in range(4))], pbar_desc="langgraph"
        )
        (group,) = groups
        assert sorted(t.reward for t in group) == [0, 1 / 3, 2 / 3, 1]
        for trajectory in group:
            wire = trajectory.to_wire()
            assert wire.messages[0].role == "user" and wire.messages[0].content == "Add 2 and 3."
            assistant = [m for m in wire.messages if m.role == "assistant"]
            assert assistant, wire.messages
            for message in assistant:
                assert message.sample is not None and message.sample.token_ids
                assert len(message.sample.token_ids) == len(message.sample.logprobs) <= 6
            assert {t.function.name for t in wire.tools} == {"add", "shout"}
            assert trajectory.initial_policy_version == 0 and trajectory.final_policy_version == 0
        sampled = sum(
            len(m.sample.token_ids) for t in group for m in t.to_wire().messages if m.sample is not None
        )
        result = await model.train(groups, config=art.TrainConfig(learning_rate=1e-3))
        assert result.step == 1 and await model.get_step() == 1
        # The step trained on the captured samples: every sampled token, and nothing else.
        assert result.metrics["trajectories_used"] == 4 and result.metrics["groups_trained"] == 1
        assert result.metrics["tokens_trained"] == sampled
    finally:
        await backend.close()
