"""MCP tools and resources as plain data, generated scenarios, and the ``complete_task`` tool."""

from __future__ import annotations

import json
import os
import random
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The name of the tool that ends an episode (not an MCP tool: the rollout handles it).
COMPLETE_TASK_TOOL_NAME = "complete_task"

#: An OpenAI ``tools`` entry the model calls, with a summary, when it believes the task is done.
complete_task_tool: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": COMPLETE_TASK_TOOL_NAME,
        "description": "Complete the task with a summary of what was done and the results.",
        "parameters": {
            "type": "object",
            "properties": {
                "summary": {"type": "string", "description": "Summary of accomplishments and results"}
            },
            "required": ["summary"],
        },
    },
}


def _field(obj: Any, *names: str, default: Any = None) -> Any:
    """An attribute or key under any of ``names`` (mcp v1 is camelCase, v2 snake_case)."""
    for name in names:
        value = obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)
        if value is not None:
            return value
    return default


@dataclass
class MCPTool:
    """One tool of an MCP server: its name, description and JSON Schema of its arguments."""

    name: str
    description: str
    parameters: dict[str, Any]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MCPTool:
        return cls(
            name=data.get("name", ""),
            description=data.get("description") or "",
            parameters=_field(data, "parameters", "inputSchema", "input_schema", default={}),
        )

    @classmethod
    def from_mcp(cls, tool: Any) -> MCPTool:
        """From an ``mcp.types.Tool`` (as ``session.list_tools()`` returns it), or a dict."""
        if isinstance(tool, dict):
            return cls.from_dict(tool)
        return cls(
            name=tool.name,
            description=tool.description or "",
            parameters=dict(_field(tool, "input_schema", "inputSchema", default={})),
        )

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "parameters": self.parameters}

    def to_openai(self) -> dict[str, Any]:
        """An OpenAI chat-completions ``tools`` entry (what Artery's inference renders for the model)."""
        parameters = dict(self.parameters or {})
        parameters.setdefault("type", "object")
        parameters.setdefault("properties", {})
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description or f"MCP tool: {self.name}",
                "parameters": parameters,
            },
        }


def tools_to_openai(tools: Iterable[Any], *, complete_task: bool = True) -> list[dict[str, Any]]:
    """OpenAI ``tools`` for MCP tools (``MCPTool``, ``mcp.types.Tool`` or dicts), plus ``complete_task``."""
    out = [(t if isinstance(t, MCPTool) else MCPTool.from_mcp(t)).to_openai() for t in tools]
    if complete_task:
        out.append(complete_task_tool)
    return out


@dataclass
class MCPResource:
    """One resource of an MCP server."""

    uri: str
    name: str
    description: str
    mime_type: str | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MCPResource:
        return cls(
            uri=str(data.get("uri", "")),
            name=data.get("name") or "",
            description=data.get("description") or "",
            mime_type=_field(data, "mimeType", "mime_type"),
        )

    @classmethod
    def from_mcp(cls, resource: Any) -> MCPResource:
        if isinstance(resource, dict):
            return cls.from_dict(resource)
        return cls(
            uri=str(resource.uri),
            name=resource.name or "",
            description=resource.description or "",
            mime_type=_field(resource, "mime_type", "mimeType"),
        )

    def to_dict(self) -> dict[str, Any]:
        out = {"uri": self.uri, "name": self.name, "description": self.description}
        if self.mime_type:
            out["mimeType"] = self.mime_type
        return out


@dataclass
class GeneratedScenario:
    """A task for an agent using the server's tools, with a difficulty from 1 to 5."""

    task: str
    difficulty: int

    def __post_init__(self) -> None:
        if not isinstance(self.task, str) or not self.task.strip():
            raise ValueError("a scenario's task must be a non-empty string")
        if isinstance(self.difficulty, bool) or not isinstance(self.difficulty, int):
            raise ValueError(f"difficulty must be an integer between 1 and 5, not {self.difficulty!r}")
        if not 1 <= self.difficulty <= 5:
            raise ValueError(f"difficulty must be an integer between 1 and 5, not {self.difficulty}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GeneratedScenario:
        return cls(task=data["task"], difficulty=data["difficulty"])

    def to_dict(self) -> dict[str, Any]:
        return {"task": self.task, "difficulty": self.difficulty}

    def preview(self, max_length: int = 120) -> str:
        return self.task if len(self.task) <= max_length else self.task[:max_length].strip() + "…"


class GeneratedScenarioCollection:
    """Scenarios with ART's helpers: split, shuffle, filter, distribution, preview, JSON."""

    def __init__(self, scenarios: list[GeneratedScenario]):
        self.scenarios = list(scenarios)

    @classmethod
    def from_dicts(cls, data: Iterable[dict[str, Any]]) -> GeneratedScenarioCollection:
        return cls([GeneratedScenario.from_dict(item) for item in data])

    @classmethod
    def from_json(cls, text: str) -> GeneratedScenarioCollection:
        data = json.loads(text)
        if isinstance(data, dict):
            data = data["scenarios"] if "scenarios" in data else next(iter(data.values()))
        return cls.from_dicts(data)

    def to_dicts(self) -> list[dict[str, Any]]:
        return [s.to_dict() for s in self.scenarios]

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps({"scenarios": self.to_dicts()}, indent=indent, ensure_ascii=False)

    def save(self, path: str | os.PathLike) -> Path:
        """Write ``{"scenarios": [...]}`` (atomically), e.g. under the model's directory."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(self.to_json(indent=2))
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> GeneratedScenarioCollection:
        return cls.from_json(Path(path).read_text())

    def __len__(self) -> int:
        return len(self.scenarios)

    def __iter__(self) -> Iterator[GeneratedScenario]:
        return iter(self.scenarios)

    def __getitem__(self, index):
        return self.scenarios[index]

    def shuffle(self, seed: int | None = None) -> GeneratedScenarioCollection:
        shuffled = self.scenarios.copy()
        (random.Random(seed) if seed is not None else random).shuffle(shuffled)
        return GeneratedScenarioCollection(shuffled)

    def split(self, train_size: int) -> tuple[GeneratedScenarioCollection, GeneratedScenarioCollection]:
        if train_size > len(self.scenarios):
            raise ValueError(
                f"train_size ({train_size}) cannot be larger than total scenarios ({len(self.scenarios)})"
            )
        return (
            GeneratedScenarioCollection(self.scenarios[:train_size]),
            GeneratedScenarioCollection(self.scenarios[train_size:]),
        )

    def filter_by_difficulty(
        self, min_difficulty: int = 1, max_difficulty: int = 5
    ) -> GeneratedScenarioCollection:
        return GeneratedScenarioCollection(
            [s for s in self.scenarios if min_difficulty <= s.difficulty <= max_difficulty]
        )

    def get_difficulty_distribution(self) -> Counter:
        return Counter(s.difficulty for s in self.scenarios)

    def preview(self, n: int = 5, max_task_length: int = 120) -> None:
        for i, scenario in enumerate(self.scenarios[:n], 1):
            print(f"   {i}. {scenario.preview(max_task_length)}  (difficulty {scenario.difficulty}/5)")

    def print_difficulty_distribution(self) -> None:
        counts = self.get_difficulty_distribution()
        print("Difficulty distribution:")
        for d in range(1, 6):
            print(f"   {d}/5: {counts.get(d, 0):3d}  {'█' * min(counts.get(d, 0), 30)}")

    def get_summary(self) -> dict[str, Any]:
        n = len(self.scenarios)
        return {
            "total_scenarios": n,
            "difficulty_distribution": dict(self.get_difficulty_distribution()),
            "avg_difficulty": sum(s.difficulty for s in self.scenarios) / n if n else 0,
            "avg_task_length": sum(len(s.task) for s in self.scenarios) / n if n else 0,
        }
