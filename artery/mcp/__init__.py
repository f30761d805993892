"""``art.mcp``: MCP•RL, teaching a model to use an MCP server (ART's ``art.mcp``).

Read a server's tools and resources with the ``mcp`` package (stdio or streamable HTTP), generate
training scenarios for them with any LLM (:func:`generate_scenarios`, given the tools or a
``server_url``), and run the model's tool calls through the MCP client in a rollout
(:func:`execute_tool_calls`; :func:`mcp_rollout` runs a whole episode on a server named by its URL
or command, discovering its tools); ``complete_task_tool`` lets the model end an episode.
``examples/mcp_rl/`` puts it together with RULER and training.

Needs the ``mcp`` extra: ``pip install 'artery[mcp]'``.
"""

try:
    import mcp as _mcp  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        "artery.mcp needs the Model Context Protocol SDK (the 'mcp' package): pip install 'artery[mcp]'"
    ) from exc

from artery.generation import GenerationError
from artery.mcp.client import (
    ToolCallsOutcome,
    call_mcp_tool,
    discover_tools,
    execute_tool_calls,
    list_tools_and_resources,
    mcp_session,
    server_spec,
    tool_result_text,
)
from artery.mcp.generate_scenarios import generate_scenarios, preview_scenarios
from artery.mcp.rollout import mcp_rollout
from artery.mcp.types import (
    COMPLETE_TASK_TOOL_NAME,
    GeneratedScenario,
    GeneratedScenarioCollection,
    MCPResource,
    MCPTool,
    complete_task_tool,
    tools_to_openai,
)

__all__ = [
    "COMPLETE_TASK_TOOL_NAME",
    "GeneratedScenario",
    "GeneratedScenarioCollection",
    "GenerationError",
    "MCPResource",
    "MCPTool",
    "ToolCallsOutcome",
    "call_mcp_tool",
    "complete_task_tool",
    "discover_tools",
    "execute_tool_calls",
    "generate_scenarios",
    "list_tools_and_resources",
    "mcp_rollout",
    "mcp_session",
    "preview_scenarios",
    "server_spec",
    "tool_result_text",
    "tools_to_openai",
]
