"""The example agents in ``examples/``: their pure parts, the tool loop, and each script end to end
on the embedded stack with the tiny model (the tool-use one judged by a scripted RULER judge)."""

from __future__ import annotations

import json
import re

import pytest

from artery.testing.judge import serve_scripted_judge
from tests.example_helpers import FakeClient, completion, history, load_example, script_help
from tests.example_helpers import scores_by_id as score_by_id

single_turn = load_example("single_turn")
tool_use = load_example("tool_use")


# ---------------------------------------------------------------- pure parts


def test_single_turn_reward():
    assert single_turn.reward("Positive.", "positive") == 1.0
    assert single_turn.reward("negative", "positive") == 0.0
    assert single_turn.reward("", "positive") == 0.0
    assert 0.0 < single_turn.reward("posit", "positive") < 0.5
    assert single_turn.reward("xyz", "positive") < single_turn.reward("positiv", "positive")


def test_calculator_tool():
    assert tool_use.calculate("(12 + 7) * 3 - 4 / 2") == 55
    assert tool_use.run_tool("calculator", '{"expression": "6 * 7"}') == ('{"result": 42}', True)
    assert tool_use.run_tool("calculator", '{"expression": "1 / 4"}') == ('{"result": 0.25}', True)
    for name, arguments, message in [
        ("calculator", '{"expression": "__import__(\'os\')"}', "only numbers"),
        ("calculator", '{"expression": "1 / 0"}', "division by zero"),
        ("calculator", '{"expression": "2 ** 3"}', "only numbers"),
        ("calculator", "not json", "Expecting value"),
        ("calculator", '{"expr": "1"}', "expected arguments"),
        ("search", "{}", "unknown tool 'search'"),
    ]:
        content, ok = tool_use.run_tool(name, arguments)
        assert not ok and message in json.loads(content)["error"], (arguments, content)
    assert tool_use.is_correct("The answer is 1,234.", 1234) and not tool_use.is_correct("12", 1234)


async def test_tool_loop_runs_calls_and_keeps_the_history():
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "calculator", "arguments": '{"expression": "6 * 7"}'},
    }
    client = FakeClient(
        [
            completion({"content": None, "tool_calls": [call]}, [5, 6, 7]),
            completion({"content": "42"}, [8, 9]),
        ]
    )
    trajectory = await tool_use.rollout(client, "agent", "What is 6 * 7?", 42, max_turns=4)
    assert len(client.requests) == 2
    assert all(r["tools"] == tool_use.TOOLS and r["logprobs"] is True for r in client.requests)
    second = client.requests[1]["messages"]
    assert [m["role"] for m in second] == ["system", "user", "assistant", "tool"]
    assert second[2]["tool_calls"][0]["function"]["name"] == "calculator"
    assert second[3] == {"role": "tool", "tool_call_id": "call_1", "content": '{"result": 42}'}
    assert trajectory.reward == 1.0
    assert {
        k: trajectory.metrics[k] for k in ("correct", "turns", "tool_calls", "tool_errors", "answered")
    } == {
        "correct": 1.0,
        "turns": 2,
        "tool_calls": 1,
        "tool_errors": 0,
        "answered": 1.0,
    }
    wire = trajectory.to_wire()
    assert [m.role for m in wire.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert wire.messages[2].sample.token_ids == [5, 6, 7] and wire.messages[4].sample.token_ids == [8, 9]
    assert wire.tools[0].function.name == "calculator"


async def test_tool_loop_stops_after_max_turns():
    call = {"id": "c", "type": "function", "function": {"name": "nope", "arguments": "{}"}}
    client = FakeClient([completion({"content": None, "tool_calls": [call]}, [1]) for _ in range(2)])
    trajectory = await tool_use.rollout(client, "agent", "What is 1 + 1?", 2, max_turns=2)
    assert trajectory.reward == 0.0
    assert trajectory.metrics["turns"] == 2 and trajectory.metrics["tool_errors"] == 2
    assert trajectory.metrics["answered"] == 0.0 and trajectory.messages()[-1]["role"] == "tool"


@pytest.mark.parametrize("name", ["single_turn", "tool_use"])
def test_scripts_run_standalone(name):
    out = script_help(name)
    assert "--base-model" in out and "--nats-url" in out


# ---------------------------------------------------------------- end to end on the embedded stack


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_single_turn_example_trains(tmp_path):
    path = tmp_path / "artery"
    summary = single_turn.main(
        ["--steps", "2", "--groups", "2", "--group-size", "4", "--backend-path", str(path)]
    )
    assert summary["steps"] == 2 and summary["final_step"] == 2
    assert [p["new_step"] for p in summary["curve"]] == [1, 2]
    assert all(p["trajectories"] == 8 for p in summary["curve"])
    rows = {row["step"]: row for row in history(path, "single-turn-001")}
    for point in summary["curve"]:
        row = rows[point["new_step"]]
        # The trainer saw the rewards the agent computed.
        assert row["train/reward_mean"] == pytest.approx(point["reward"])
        assert row["train/trajectories"] == 8
    assert any(rows[p["new_step"]]["train/tokens_trained"] > 0 for p in summary["curve"])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tool_use_example_trains_on_ruler_scores(tmp_path):
    path = tmp_path / "artery"
    with serve_scripted_judge() as judge:
        judge.answers = [score_by_id]
        summary = tool_use.main(
            [
                "--steps", "1",
                "--groups", "2",
                "--group-size", "3",
                "--max-turns", "2",
                "--max-tokens", "16",
                "--backend-path", str(path),
                "--judge-model", "openai/judge",
                "--judge-api-base", judge.api_base,
            ]
        )  # fmt: skip
    assert summary["steps"] == 1 and summary["final_step"] == 1 and summary["judge_failures"] == 0
    # One judge call per group, with the tools and every trajectory in its prompt.
    assert len(judge.requests) == 2
    for body in judge.requests:
        assert body["model"] == "judge" and body["response_format"]["type"] == "json_schema"
        prompt = body["messages"][1]["content"]
        assert "<available_tools>" in prompt and '"name": "calculator"' in prompt
        assert re.findall(r'<trajectory id="(\d+)">', prompt) == ["1", "2", "3"]
        assert "Using the calculator tool" in body["messages"][0]["content"]  # the example's rubric
    rows = {row["step"]: row for row in history(path, "tool-use-001")}
    for point in summary["curve"]:
        assert point["ruler_scored"] == point["trajectories"] == 6
        assert point["reward"] == pytest.approx(2 / 3)  # the judge's 1/3, 2/3, 1 in each group
        row = rows[point["new_step"]]
        assert row["train/reward_mean"] == pytest.approx(2 / 3)
        assert row["train/tokens_trained"] > 0 and row["train/groups_trained"] == 2
        assert "train/independent_reward" in row and row["train/ruler_score"] == pytest.approx(2 / 3)
