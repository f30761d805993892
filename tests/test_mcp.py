"""MCP•RL (``artery.mcp``): a real MCP server of ours over stdio and streamable HTTP, the model's tool
calls run through the MCP client, scenario generation against a scripted OpenAI-compatible server
(the re-ask and the clear error included), and ``examples/mcp_rl`` training 2 steps end to end on
the embedded stack with the reward service's RULER."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from artery.testing.judge import serve_scripted_judge
from tests.example_helpers import (
    FakeClient,
    completion,
    history,
    load_example,
    scores_by_id,
    script_help,
    scripted_llms,
)

pytest.importorskip("mcp")

from mcp import StdioServerParameters

import artery.mcp as art_mcp
from artery.auto import GenerationError
from artery.mcp import (
    GeneratedScenario,
    GeneratedScenarioCollection,
    MCPResource,
    MCPTool,
    complete_task_tool,
    execute_tool_calls,
    generate_scenarios,
    list_tools_and_resources,
    mcp_session,
    tools_to_openai,
)

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "mcp_rl"
TOOL_NAMES = ["convert_length", "convert_mass", "convert_temperature", "list_units"]


example = load_example("mcp_rl")


def stdio_server() -> StdioServerParameters:
    return StdioServerParameters(command=sys.executable, args=[str(EXAMPLE / "server.py")])


def call(call_id: str, name: str, arguments: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


# ---------------------------------------------------------------- the package without a server


def test_import_without_the_extra_names_it():
    code = "import sys; sys.modules['mcp'] = None\nimport artery.mcp"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode != 0
    assert "ImportError" in out.stderr and "pip install 'artery[mcp]'" in out.stderr


def test_art_names_exist():
    for name in ("MCPTool", "MCPResource", "GeneratedScenario", "GeneratedScenarioCollection"):
        assert hasattr(art_mcp, name)
    assert (
        callable(art_mcp.generate_scenarios)
        and art_mcp.complete_task_tool["function"]["name"] == "complete_task"
    )


def test_tools_convert_to_openai_entries():
    tool = MCPTool.from_dict(
        {"name": "add", "description": "Add", "inputSchema": {"type": "object", "properties": {"a": {}}}}
    )
    assert tool.to_openai() == {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add",
            "parameters": {"type": "object", "properties": {"a": {}}},
        },
    }
    bare = MCPTool(name="ping", description="", parameters={})
    assert bare.to_openai()["function"] == {
        "name": "ping",
        "description": "MCP tool: ping",
        "parameters": {"type": "object", "properties": {}},
    }
    assert tools_to_openai([tool, bare])[-1] is complete_task_tool
    assert len(tools_to_openai([tool], complete_task=False)) == 1
    assert MCPResource.from_dict({"uri": "a://b", "name": "b", "mimeType": "text/plain"}).to_dict() == {
        "uri": "a://b",
        "name": "b",
        "description": "",
        "mimeType": "text/plain",
    }


def test_scenarios_validate_and_round_trip(tmp_path):
    for bad in (0, 6, 2.5, True, "3"):
        with pytest.raises(ValueError, match="difficulty"):
            GeneratedScenario(task="t", difficulty=bad)
    with pytest.raises(ValueError, match="non-empty"):
        GeneratedScenario(task=" ", difficulty=1)
    collection = GeneratedScenarioCollection([GeneratedScenario(f"task {i}", 1 + i % 5) for i in range(7)])
    train, val = collection.split(5)
    assert (len(train), len(val)) == (5, 2)
    with pytest.raises(ValueError, match="cannot be larger"):
        collection.split(8)
    assert [s.difficulty for s in collection.filter_by_difficulty(4, 5)] == [4, 5]
    assert collection.get_difficulty_distribution()[1] == 2
    assert collection.get_summary()["total_scenarios"] == 7
    path = collection.save(tmp_path / "s.json")
    assert GeneratedScenarioCollection.load(path).to_dicts() == collection.to_dicts()
    assert GeneratedScenarioCollection.from_json(json.dumps(collection.to_dicts())).to_dicts() == (
        collection.to_dicts()
    )
    assert [s.task for s in collection.shuffle(seed=1)] == [s.task for s in collection.shuffle(seed=1)]


# ---------------------------------------------------------------- a real MCP server: stdio and HTTP


async def test_stdio_server_lists_tools_and_resources_and_runs_tool_calls():
    tools, resources = await list_tools_and_resources(stdio_server())
    assert [t.name for t in tools] == TOOL_NAMES
    length = tools[0]
    assert "mi" in length.description and length.parameters["required"] == ["value", "from_unit", "to_unit"]
    assert [(r.uri, r.name) for r in resources] == [("units://catalog", "catalog")]

    async with mcp_session(stdio_server()) as session:
        outcome = await execute_tool_calls(
            session,
            [
                call("a", "convert_length", '{"value": 3, "from_unit": "km", "to_unit": "m"}'),
                call("b", "convert_temperature", '{"value": 100, "from_unit": "C", "to_unit": "F"}'),
                call("c", "convert_mass", '{"value": 1, "from_unit": "stone", "to_unit": "kg"}'),
                call("d", "teleport", "{}"),
                call("e", "convert_mass", "[1, 2]"),
                call("f", "complete_task", '{"summary": "3 km is 3000 m"}'),
            ],
        )
    contents = [m["content"] for m in outcome.messages]
    assert [m["tool_call_id"] for m in outcome.messages] == list("abcdef")
    assert all(m["role"] == "tool" for m in outcome.messages)
    assert json.loads(contents[0]) == {"value": 3000.0, "unit": "m"}  # computed by the server
    assert json.loads(contents[1]) == {"value": 212.0, "unit": "F"}
    assert contents[2].startswith("Error") and "unknown unit 'stone'" in contents[2]
    assert contents[3].startswith("Error") and "teleport" in contents[3]
    assert contents[4].startswith("Error") and "not a JSON object" in contents[4]
    assert contents[5] == "Task marked complete."
    assert (outcome.calls, outcome.errors, outcome.completed, outcome.summary) == (
        5,
        3,
        True,
        "3 km is 3000 m",
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_http_server(port: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(EXAMPLE / "server.py"), "--transport", "streamable-http", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


async def test_streamable_http_server_lists_and_calls():
    port = free_port()
    proc = start_http_server(port)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
                assert time.monotonic() < deadline, "the HTTP MCP server did not start"
                await asyncio.sleep(0.1)
        url = f"http://127.0.0.1:{port}/mcp"
        tools, resources = await list_tools_and_resources(url)
        assert [t.name for t in tools] == TOOL_NAMES and resources[0].uri == "units://catalog"
        result = await art_mcp.call_mcp_tool(
            url, "convert_mass", {"value": 2, "from_unit": "kg", "to_unit": "g"}
        )
        assert json.loads(art_mcp.tool_result_text(result)) == {"value": 2000.0, "unit": "g"}
        async with mcp_session(url) as session:
            units = await execute_tool_calls(session, [call("u", "list_units", '{"kind": "temperature"}')])
        assert json.loads(units.messages[0]["content"]) == ["C", "F", "K"] and units.errors == 0
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# ---------------------------------------------------------------- the example's rollout, MCP in the loop


async def test_rollout_runs_the_models_tool_calls_through_the_mcp_server():
    async with mcp_session(stdio_server()) as session:
        tools, _ = await list_tools_and_resources(session)
        openai_tools = tools_to_openai(tools)
        client = FakeClient(
            [
                completion(
                    {
                        "content": None,
                        "tool_calls": [
                            call("c1", "convert_length", '{"value": 2, "from_unit": "ft", "to_unit": "in"}')
                        ],
                    },
                    [1, 2, 3],
                ),
                completion(
                    {"content": None, "tool_calls": [call("c2", "complete_task", '{"summary": "24 in"}')]},
                    [1, 2, 3],
                ),
            ]
        )
        done = await example.rollout(client, "agent", session, openai_tools, "How many inches in 2 ft?")
        # A model turn without a tool call ends the episode (what the tiny model mostly does).
        silent = await example.rollout(
            FakeClient([completion({"content": "no idea"}, [1, 2, 3])]), "agent", session, openai_tools, "x"
        )
    assert [r["tools"] for r in client.requests] == [openai_tools, openai_tools]
    second = client.requests[1]["messages"]
    assert [m["role"] for m in second] == ["system", "user", "assistant", "tool"]
    assert second[3]["tool_call_id"] == "c1" and json.loads(second[3]["content"]) == {
        "value": 24.0,
        "unit": "in",
    }
    assert done.metrics["tool_calls"] == 1 and done.metrics["tool_errors"] == 0
    assert done.metrics["task_completed"] == 1.0 and done.metrics["turns"] == 2 and done.reward == 1.0
    assert done.metadata["summary"] == "24 in" and done.messages()[-1]["content"] == "Task marked complete."
    assert [m.role for m in done.to_wire().messages] == [
        "system",
        "user",
        "assistant",
        "tool",
        "assistant",
        "tool",
    ]
    assert silent.metrics["turns"] == 1 and silent.metrics["task_completed"] == 0.0 and silent.reward == 0.0


# ---------------------------------------------------------------- scenario generation


def scenarios_json(n: int, difficulty: int = 2) -> str:
    return json.dumps(
        {"scenarios": [{"task": f"Convert {i} km to miles", "difficulty": difficulty} for i in range(n)]}
    )


TOOLS = [MCPTool("convert_length", "Convert a length", {"type": "object", "properties": {}})]


async def test_generate_scenarios_asks_with_a_json_schema_and_checks_the_count():
    with serve_scripted_judge() as server:
        server.answers = [scenarios_json(3)]
        collection = await generate_scenarios(
            TOOLS,
            [MCPResource("units://catalog", "catalog", "units")],
            num_scenarios=3,
            show_preview=False,
            custom_instructions="Only metric units.",
            generator_model="openai/generator",
            generator_base_url=server.api_base,
        )
    assert [s.task for s in collection] == [f"Convert {i} km to miles" for i in range(3)]
    [body] = server.requests
    assert body["model"] == "generator"
    schema = body["response_format"]["json_schema"]["schema"]["properties"]["scenarios"]
    assert body["response_format"]["type"] == "json_schema" and schema["minItems"] == schema["maxItems"] == 3
    prompt = body["messages"][0]["content"]
    assert (
        '"name": "convert_length"' in prompt
        and "units://catalog" in prompt
        and "Only metric units." in prompt
    )


async def test_generate_scenarios_asks_again_once_then_fails_clearly():
    with serve_scripted_judge() as server:
        server.answers = [scenarios_json(2), scenarios_json(3)]  # a wrong count, then right
        collection = await generate_scenarios(
            TOOLS,
            num_scenarios=3,
            show_preview=False,
            generator_model="openai/g",
            generator_base_url=server.api_base,
        )
        assert len(collection) == 3 and len(server.requests) == 2
        reask = server.requests[1]["messages"]
        assert [m["role"] for m in reask] == ["user", "assistant", "user"]
        assert "expected exactly 3 scenarios, got 2" in reask[2]["content"]

        server.requests.clear()
        server.answers = [scenarios_json(3, difficulty=9), "not json at all"]
        with pytest.raises(GenerationError) as caught:
            await generate_scenarios(
                TOOLS,
                num_scenarios=3,
                show_preview=False,
                generator_model="openai/g",
                generator_base_url=server.api_base,
            )
        assert len(server.requests) == 2  # one re-ask, no more
        assert "difficulty must be an integer between 1 and 5" in server.requests[1]["messages"][2]["content"]
        message = str(caught.value)
        assert "openai/g" in message and "after 2 attempts" in message and "not JSON" in message
        assert "not json at all" in message
    with pytest.raises(ValueError, match="At least one tool"):
        await generate_scenarios([], [], num_scenarios=1)


def test_script_runs_standalone():
    out = script_help("mcp_rl")
    assert "--generator-model" in out and "--judge-model" in out and "--mcp-url" in out


# ---------------------------------------------------------------- end to end on the embedded stack


def answer(body: dict) -> str:
    """Scenarios for the generator; for the judge, trajectory ``i`` of ``n`` scores ``i / n``."""
    if body["response_format"]["json_schema"]["name"] == "scenario_list":
        n = body["response_format"]["json_schema"]["schema"]["properties"]["scenarios"]["minItems"]
        return scenarios_json(n)
    return scores_by_id(body)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_mcp_rl_example_trains_two_steps_judged_by_the_reward_service(tmp_path):
    path = tmp_path / "artery"
    with serve_scripted_judge() as server:
        server.answers = [answer]
        summary = example.main(
            [
                "--steps", "2",
                "--groups", "1",
                "--group-size", "3",
                "--max-turns", "2",
                "--max-tokens", "24",
                "--backend-path", str(path),
                *scripted_llms(server.api_base, "generator", "judge"),
            ]
        )  # fmt: skip
    assert summary["tools"] == TOOL_NAMES and summary["resources"] == ["units://catalog"]
    assert summary["steps"] == 2 and summary["final_step"] == 2
    assert [p["new_step"] for p in summary["curve"]] == [1, 2]
    # One generator call, then one judge call per group, made by the reward service.
    generator = [b for b in server.requests if b["model"] == "generator"]
    judge = [b for b in server.requests if b["model"] == "judge"]
    assert len(generator) == 1 and len(judge) == 2
    for body in judge:
        text = "\n".join(str(m.get("content")) for m in body["messages"])
        assert '"convert_length"' in text and '"complete_task"' in text  # the tools beside the trajectories
        assert "complete_task and a summary" in body["messages"][0]["content"]  # the example's rubric
    stored = json.loads(Path(summary["scenarios_path"]).read_text())
    assert len(stored["scenarios"]) == 2 and Path(summary["scenarios_path"]).parent.name == "mcp-rl-001"
    rows = {r["step"]: r for r in history(path, "mcp-rl-001")}
    for point in summary["curve"]:
        row = rows[point["new_step"]]
        assert row["train/reward_mean"] == pytest.approx(2 / 3)  # the judge's 1/3, 2/3, 1
        assert row["train/tokens_trained"] > 0 and row["train/trajectories"] == 3
