"""Scenario generation for an MCP server's tools, with any LLM (ART's ``art.mcp.generate_scenarios``)."""

from __future__ import annotations

import json
import time
from typing import Any

from artery.generation import DEFAULT_GENERATOR_MODEL, counted_list, generate_json
from artery.mcp.client import list_tools_and_resources, server_spec
from artery.mcp.types import GeneratedScenario, GeneratedScenarioCollection, MCPResource, MCPTool


def preview_scenarios(scenarios: list[dict[str, Any]] | GeneratedScenarioCollection, n: int = 5) -> None:
    """Print the first ``n`` scenarios (dicts or a collection)."""
    items = scenarios.to_dicts() if isinstance(scenarios, GeneratedScenarioCollection) else scenarios
    for i, s in enumerate(items[:n], 1):
        task = s["task"]
        more = "…" if len(task) > 120 else ""
        print(f"   {i}. {task[:120].strip()}{more}  (difficulty {s.get('difficulty', 'N/A')}/5)")


def scenarios_schema(num_scenarios: int) -> dict[str, Any]:
    """The response's JSON Schema: exactly ``num_scenarios`` tasks with a difficulty of 1 to 5."""
    return {
        "type": "object",
        "properties": {
            "scenarios": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "task": {"type": "string"},
                        "difficulty": {"type": "integer", "minimum": 1, "maximum": 5},
                    },
                    "required": ["task", "difficulty"],
                    "additionalProperties": False,
                },
                "minItems": num_scenarios,
                "maxItems": num_scenarios,
            }
        },
        "required": ["scenarios"],
        "additionalProperties": False,
    }


def _tool_dicts(tools: list[Any]) -> list[dict[str, Any]]:
    return [(t if isinstance(t, MCPTool) else MCPTool.from_mcp(t)).to_dict() for t in tools]


def _resource_dicts(resources: list[Any] | None) -> list[dict[str, Any]]:
    return [(r if isinstance(r, MCPResource) else MCPResource.from_mcp(r)).to_dict() for r in resources or []]


def build_prompt(
    tools_info: list[dict[str, Any]],
    resources_info: list[dict[str, Any]],
    num_scenarios: int,
    custom_instructions: str | None = None,
) -> str:
    resources_text = json.dumps(resources_info, indent=2) if resources_info else "No resources available"
    prompt = f"""You create realistic scenarios for testing AI agents that use the tools of an MCP (Model Context Protocol) server.

From the tools and resources below, write {num_scenarios} diverse, realistic tasks a user might want done with them.

AVAILABLE TOOLS:
{json.dumps(tools_info, indent=2)}

AVAILABLE RESOURCES:
{resources_text}

Requirements:
1. Each task can be accomplished with the available tools.
2. Tasks vary in complexity: some need one or two tool calls, some several.
3. Tasks cover different use cases and combinations of tools, without naming which tools to use.
4. Each task is realistic: something a real user would want.
5. Each has a difficulty from 1 (easy, a single tool call) to 5 (hard, multi-step analysis).
6. Each task asks for a summary of the work done and a report of the results at the end.

Respond with a JSON object whose "scenarios" array holds exactly {num_scenarios} objects, each with
"task" (a string) and "difficulty" (an integer from 1 to 5)."""  # noqa: E501
    if custom_instructions:
        prompt += (
            "\n\nPay close attention to the following instructions when generating scenarios:\n\n"
            + custom_instructions
        )
    return prompt


async def generate_scenarios(
    tools: list[MCPTool] | list[dict[str, Any]] | list[Any] | None = None,
    resources: list[MCPResource] | list[dict[str, Any]] | list[Any] | None = None,
    num_scenarios: int = 24,
    show_preview: bool = True,
    custom_instructions: str | None = None,
    generator_model: str = DEFAULT_GENERATOR_MODEL,
    generator_api_key: str | None = None,
    generator_base_url: str | None = None,
    *,
    extra_litellm_params: dict[str, Any] | None = None,
    server_url: str | None = None,
    server_command: str | list[str] | None = None,
) -> GeneratedScenarioCollection:
    """Generate ``num_scenarios`` tasks for an MCP server's tools and resources.

    ``generator_model`` is any litellm model name (``openai/gpt-4.1-mini``,
    ``openrouter/...``; ``openai/<name>`` with ``generator_base_url`` for any OpenAI-compatible
    server, Artery's own endpoint included; or pass ``model.litellm_completion_params()`` as
    ``extra_litellm_params``). The answer must follow a JSON schema with exactly
    ``num_scenarios`` items; a wrong count, a difficulty outside 1-5 or malformed JSON is asked
    again once, then :class:`artery.generation.GenerationError` is raised.
    ``generator_api_key`` unset: the provider's usual environment variable (``OPENAI_API_KEY``...).

    ``server_url`` (streamable HTTP) or ``server_command`` (a program speaking MCP on stdio), as
    ART's ``generate_scenarios(num_scenarios=24, server_url=...)``: the tools and resources are
    read from that server instead of being passed.
    """
    if num_scenarios < 1:
        raise ValueError("num_scenarios must be at least 1")
    if server_url is not None or server_command is not None:
        if tools is not None or resources is not None:
            raise ValueError("pass the tools and resources, or the server to read them from, not both")
        tools, resources = await list_tools_and_resources(server_spec(server_url, server_command))
    if not tools and not resources:
        raise ValueError("At least one tool or resource must be provided")
    started = time.perf_counter()
    tools_info, resources_info = _tool_dicts(list(tools or [])), _resource_dicts(resources)

    def check(answer: Any) -> GeneratedScenarioCollection:
        items = counted_list(answer, "scenarios", num_scenarios, '{"task": ..., "difficulty": ...}')
        scenarios = []
        for i, item in enumerate(items):
            if not isinstance(item, dict) or "task" not in item or "difficulty" not in item:
                raise ValueError(f"scenario {i} is not an object with a task and a difficulty")
            try:
                scenarios.append(GeneratedScenario.from_dict(item))
            except ValueError as exc:
                raise ValueError(f"scenario {i}: {exc}") from None
        return GeneratedScenarioCollection(scenarios)

    collection = await generate_json(
        [
            {
                "role": "user",
                "content": build_prompt(tools_info, resources_info, num_scenarios, custom_instructions),
            }
        ],
        scenarios_schema(num_scenarios),
        check,
        schema_name="scenario_list",
        generator_model=generator_model,
        generator_api_key=generator_api_key,
        generator_base_url=generator_base_url,
        extra_litellm_params=extra_litellm_params,
        what=f"list of {num_scenarios} scenarios",
    )
    if show_preview:
        print(
            f"Generated {len(collection)} scenarios with {generator_model} "
            f"in {time.perf_counter() - started:.2f}s"
        )
        collection.print_difficulty_distribution()
        collection.preview(n=min(5, num_scenarios))
    return collection
