"""Talking to a real MCP server with the ``mcp`` package: connect, list, call, run a model's tool calls.

A server is named by ``mcp.StdioServerParameters`` (the client starts it as a subprocess and
speaks over its stdin/stdout), by an ``http(s)://`` URL (streamable HTTP), or is an already
initialised ``mcp.ClientSession``. Works with the ``mcp`` package's v1 and v2 APIs.
"""

from __future__ import annotations

import asyncio
import json
import shlex
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from mcp import ClientSession, StdioServerParameters, stdio_client

from artery.mcp.types import COMPLETE_TASK_TOOL_NAME, MCPResource, MCPTool, _field, tools_to_openai

ServerSpec = StdioServerParameters | str | ClientSession


def _http_transport(url: str):
    from mcp.client import streamable_http

    if hasattr(streamable_http, "streamable_http_client"):  # mcp >= 1.24 and 2.x
        return streamable_http.streamable_http_client(url)
    # Older 1.x; the mcp that mypy reads is newer and no longer has the name.
    return streamable_http.streamablehttp_client(url)  # type: ignore[attr-defined]  # pragma: no cover


@asynccontextmanager
async def mcp_session(server: ServerSpec) -> AsyncIterator[ClientSession]:
    """An initialised ``ClientSession`` to ``server``; closed (and a stdio server stopped) on exit.

    Enter and leave it in the same task (anyio's rule); the session itself may be used from many
    tasks at once (requests are matched by id), so concurrent rollouts can share it.
    """
    if isinstance(server, ClientSession):
        yield server
        return
    if isinstance(server, StdioServerParameters):
        transport = stdio_client(server)
    elif isinstance(server, str) and server.startswith(("http://", "https://")):
        transport = _http_transport(server)
    else:
        raise TypeError(
            f"an MCP server is StdioServerParameters, an http(s):// URL or a ClientSession, not {server!r}"
        )
    async with transport as streams:
        read, write = streams[0], streams[1]  # v1's HTTP transport adds a third: the session id getter
        async with ClientSession(read, write) as session:
            await session.initialize()
            yield session


def server_spec(
    server_url: str | None = None, command: str | Sequence[str] | None = None
) -> StdioServerParameters | str:
    """The server named by a streamable-HTTP ``server_url`` or by the ``command`` that starts it
    on stdio (a string split as a shell would, or a list); exactly one of them."""
    if (server_url is None) == (command is None):
        raise ValueError(
            "name the MCP server by server_url (streamable HTTP) or by command (stdio), not both"
        )
    if server_url is not None:
        if not server_url.startswith(("http://", "https://")):
            raise ValueError(
                f"server_url is an http(s):// URL of a streamable-HTTP MCP server, not {server_url!r}"
            )
        return server_url
    parts = shlex.split(command) if isinstance(command, str) else list(command or [])
    if not parts:
        raise ValueError("command names the program that starts the MCP server")
    return StdioServerParameters(command=parts[0], args=parts[1:])


async def discover_tools(server: ServerSpec, *, complete_task: bool = True) -> list[dict[str, Any]]:
    """The server's tools as OpenAI ``tools`` entries (and ``complete_task``), for a rollout."""
    tools, _ = await list_tools_and_resources(server)
    return tools_to_openai(tools, complete_task=complete_task)


async def list_tools_and_resources(server: ServerSpec) -> tuple[list[MCPTool], list[MCPResource]]:
    """The server's tools and resources (a server without resources gives an empty list)."""
    async with mcp_session(server) as session:
        tools = [MCPTool.from_mcp(t) for t in (await session.list_tools()).tools]
        try:
            resources = [MCPResource.from_mcp(r) for r in (await session.list_resources()).resources]
        except Exception:  # the server does not implement resources/list
            resources = []
    return tools, resources


async def call_mcp_tool(
    server: ServerSpec, name: str, arguments: dict[str, Any] | None = None, *, timeout_s: float | None = 60.0
) -> Any:
    """Call one tool; returns the ``CallToolResult`` (``is_error``/``isError`` set on a tool error)."""
    async with mcp_session(server) as session:
        return await asyncio.wait_for(session.call_tool(name, arguments or {}), timeout_s)


def tool_result_text(result: Any) -> str:
    """The text of a ``CallToolResult`` for a ``role="tool"`` message."""
    if isinstance(result, str):
        return result
    parts = []
    for item in _field(result, "content", default=[]) or []:
        text = getattr(item, "text", None)
        parts.append(text if isinstance(text, str) else str(item))
    if parts:
        return "".join(parts)
    structured = _field(result, "structured_content", "structuredContent")
    if structured is not None:
        return json.dumps(structured)
    return str(result)


def _is_error(result: Any) -> bool:
    return bool(_field(result, "is_error", "isError", default=False))


@dataclass
class ToolCallsOutcome:
    """What running one assistant turn's tool calls gave."""

    #: ``role="tool"`` messages, one per call, in order, to append to the conversation.
    messages: list[dict[str, Any]] = field(default_factory=list)
    #: The model called ``complete_task``.
    completed: bool = False
    summary: str | None = None
    #: MCP tools called (``complete_task`` not counted) and how many of them failed.
    calls: int = 0
    errors: int = 0


def _call_parts(call: Any) -> tuple[str, str, str]:
    if isinstance(call, dict):
        fn = call.get("function") or {}
        return call.get("id") or "", fn.get("name") or "", fn.get("arguments") or ""
    return call.id, call.function.name, call.function.arguments or ""


async def execute_tool_calls(
    session: ClientSession,
    tool_calls: list[Any],
    *,
    timeout_s: float = 60.0,
    max_result_chars: int = 20_000,
) -> ToolCallsOutcome:
    """Run an assistant message's OpenAI ``tool_calls`` through the MCP session.

    Each call becomes a ``role="tool"`` message with its ``tool_call_id``: the tool's text, or
    ``Error: ...`` for arguments that are not a JSON object, a tool error, an unknown tool or a
    timeout (the episode goes on; the judge sees the error). ``complete_task`` is not sent to the
    server: it marks the episode complete with its ``summary``.
    """
    outcome = ToolCallsOutcome()
    for call in tool_calls:
        call_id, name, raw_arguments = _call_parts(call)
        try:
            arguments = json.loads(raw_arguments) if raw_arguments.strip() else {}
            if not isinstance(arguments, dict):
                raise ValueError(f"got a JSON {type(arguments).__name__}")
        except ValueError as exc:
            arguments = None
            content = f"Error: the arguments of {name!r} are not a JSON object ({exc})"
        if name == COMPLETE_TASK_TOOL_NAME:
            outcome.completed = True
            summary = (arguments or {}).get("summary")
            outcome.summary = summary if isinstance(summary, str) else raw_arguments
            content = "Task marked complete."
        elif arguments is None:
            outcome.calls += 1
            outcome.errors += 1
        else:
            outcome.calls += 1
            try:
                result = await asyncio.wait_for(session.call_tool(name, arguments), timeout_s)
                content = tool_result_text(result)
                if _is_error(result):
                    outcome.errors += 1
                    content = content if content.startswith("Error") else f"Error: {content}"
            except TimeoutError:
                outcome.errors += 1
                content = f"Error: {name!r} did not answer within {timeout_s:g}s"
            except Exception as exc:  # MCPError (unknown tool, invalid arguments), a closed session...
                outcome.errors += 1
                content = f"Error: {type(exc).__name__}: {exc}"
            if len(content) > max_result_chars:
                content = content[:max_result_chars] + f"... (cut: {len(content)} characters)"
        outcome.messages.append({"role": "tool", "tool_call_id": call_id, "content": content})
    return outcome
