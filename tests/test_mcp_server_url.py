"""MCP•RL from a server URL (ART's README: ``generate_scenarios(num_scenarios=24, server_url=...)``):
the tools are read from a real MCP server, ``examples/mcp_rl/server.py``, served by the test on
streamable HTTP (in process) and on stdio (a subprocess); ``mcp_rollout`` discovers them and runs
the model's calls there."""

from __future__ import annotations

import asyncio
import json
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("mcp")
uvicorn = pytest.importorskip("uvicorn")

import artery.mcp as art_mcp  # noqa: E402  (after the skip: it needs the mcp package)
from artery.testing.judge import serve_scripted_judge  # noqa: E402
from tests.example_helpers import FakeClient, completion  # noqa: E402
from tests.helpers import load_script  # noqa: E402

SERVER = Path(__file__).resolve().parent.parent / "examples" / "mcp_rl" / "server.py"
TOOL_NAMES = ["convert_length", "convert_mass", "convert_temperature", "list_units"]


def call(call_id: str, name: str, arguments: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def load_server_module():
    return load_script(SERVER, "mcp_rl_server")


@pytest.fixture
async def server_url() -> AsyncIterator[str]:
    """The example's MCP server on streamable HTTP, in this process (uvicorn, as its ``run`` does)."""
    app = load_server_module().build_server().streamable_http_app()
    # Bound and listening before anything connects: no port race, and no wait for the server
    # (a connection made before it accepts waits in the backlog).
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/mcp"
    finally:
        server.should_exit = True
        await serving
        sock.close()


def scenarios_json(n: int) -> str:
    return json.dumps(
        {"scenarios": [{"task": f"Convert {i} km to miles", "difficulty": 2} for i in range(n)]}
    )


async def test_generate_scenarios_reads_the_tools_from_a_server_url_or_command(server_url):
    url = server_url
    with serve_scripted_judge() as generator:
        generator.answers = [scenarios_json(3), scenarios_json(2)]
        by_url = await art_mcp.generate_scenarios(
            num_scenarios=3,
            server_url=url,
            show_preview=False,
            generator_model="openai/generator",
            generator_base_url=generator.api_base,
        )
        by_command = await art_mcp.generate_scenarios(
            num_scenarios=2,
            server_command=[sys.executable, str(SERVER)],
            show_preview=False,
            generator_model="openai/generator",
            generator_base_url=generator.api_base,
        )
    assert len(by_url) == 3 and len(by_command) == 2
    for body in generator.requests:  # the prompt lists what the server itself declared
        prompt = body["messages"][0]["content"]
        assert all(f'"name": "{name}"' in prompt for name in TOOL_NAMES) and "units://catalog" in prompt
    with pytest.raises(ValueError, match="not both"):
        await art_mcp.generate_scenarios([], num_scenarios=1, server_url=url)
    with pytest.raises(ValueError, match="http"):
        await art_mcp.generate_scenarios(num_scenarios=1, server_url="units-server")


async def test_mcp_rollout_discovers_the_servers_tools_and_runs_the_calls_there(server_url):
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
                {"content": None, "tool_calls": [call("c2", "complete_task", '{"summary": "24 in"}')]}, [1]
            ),
        ]
    )
    # The model's side is scripted (no network); the MCP side is the real server.
    model = SimpleNamespace(openai_client=lambda: client, get_inference_name=lambda: "agent@0")
    trajectory = await art_mcp.mcp_rollout(model, "How many inches in 2 ft?", server_url=server_url)
    offered = [t["function"]["name"] for t in client.requests[0]["tools"]]
    assert offered == [*TOOL_NAMES, "complete_task"]
    tool_answer = client.requests[1]["messages"][3]
    assert tool_answer["tool_call_id"] == "c1" and json.loads(tool_answer["content"]) == {
        "value": 24.0,
        "unit": "in",
    }
    assert trajectory.reward == 1.0 and trajectory.metadata["summary"] == "24 in"
    assert trajectory.metrics["tool_calls"] == 1 and trajectory.metrics["tool_errors"] == 0
    assert await art_mcp.discover_tools(server_url) == client.requests[0]["tools"]
