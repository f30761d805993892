"""One MCP•RL episode against a server named by its URL or command: the tools are discovered from
the server, the model's tool calls run through it, ``complete_task`` ends the episode."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mcp import ClientSession

from artery.mcp.client import execute_tool_calls, mcp_session, server_spec
from artery.mcp.types import MCPTool, tools_to_openai
from artery.trajectories import Trajectory

SYSTEM_PROMPT = (
    "You are an MCP (Model Context Protocol) agent. Use the server's tools to complete the task. "
    "When you have completed it, call the 'complete_task' function with a summary of what you "
    "accomplished. You have a total of {max_turns} turns."
)


async def mcp_rollout(
    model: Any,
    task: str,
    *,
    server_url: str | None = None,
    server_command: str | Sequence[str] | None = None,
    session: ClientSession | None = None,
    max_turns: int = 3,
    max_tokens: int = 128,
    temperature: float = 1.0,
    system_prompt: str = SYSTEM_PROMPT,
) -> Trajectory:
    """Run ``task`` with ``model`` (a ``TrainableModel``: its ``openai_client()`` and inference
    name) on the MCP server at ``server_url`` (streamable HTTP), started by ``server_command``
    (stdio), or reached through an open ``session`` (shared by concurrent rollouts).

    The reward is 1.0 when the model called ``complete_task``, else 0.0 (a judge such as RULER
    replaces it); ``metrics`` count turns, tool calls and tool errors.
    """
    if session is None:
        async with mcp_session(server_spec(server_url, server_command)) as opened:
            return await _episode(model, task, opened, max_turns, max_tokens, temperature, system_prompt)
    if server_url is not None or server_command is not None:
        raise ValueError("pass an open session or the server to open one to, not both")
    return await _episode(model, task, session, max_turns, max_tokens, temperature, system_prompt)


async def _episode(
    model: Any,
    task: str,
    session: ClientSession,
    max_turns: int,
    max_tokens: int,
    temperature: float,
    system_prompt: str,
) -> Trajectory:
    tools = tools_to_openai(MCPTool.from_mcp(t) for t in (await session.list_tools()).tools)
    trajectory = Trajectory(
        messages_and_choices=[
            {"role": "system", "content": system_prompt.format(max_turns=max_turns)},
            {"role": "user", "content": f"Please complete this task: {task}"},
        ],
        tools=tools,
        metadata={"task": task[:500]},
    )
    client = model.openai_client()
    calls = errors = turns = 0
    completed, summary = False, None
    while turns < max_turns and not completed:
        turns += 1
        response = await client.chat.completions.create(
            model=model.get_inference_name(),
            messages=trajectory.messages(),
            tools=tools,
            max_tokens=max_tokens,
            temperature=temperature,
            logprobs=True,
        )
        choice = response.choices[0]
        trajectory.messages_and_choices.append(choice)  # keeps the sampled token ids and logprobs
        if not choice.message.tool_calls:
            break  # an answer without a tool call ends the episode
        outcome = await execute_tool_calls(session, choice.message.tool_calls)
        trajectory.messages_and_choices.extend(outcome.messages)
        calls, errors = calls + outcome.calls, errors + outcome.errors
        completed, summary = outcome.completed, outcome.summary
    trajectory.reward = float(completed)
    trajectory.metrics.update(
        turns=turns, tool_calls=calls, tool_errors=errors, task_completed=float(completed)
    )
    if summary is not None:
        trajectory.metadata["summary"] = summary[:500]
    return trajectory.finish()
