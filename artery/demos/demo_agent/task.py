"""The demo-agent's task: questions, the tool, and the programmatic reward. Pure functions (no I/O).

Kinds of question (``KINDS``), each answered with one call of the ``calculator`` tool:

- ``times``: "What is 37 * 12?"; the model copies the expression into the call, and the result
  into its answer.
- ``words``: a one-line word problem ("A box holds 12 eggs. How many eggs are in 37 boxes?"): the
  model has to write the product itself.
- ``convert``: "How many grams are in 37 kilograms?": the model has to write the conversion.

The reward rule (``reward``), the same for every kind:

- **1.0**: the episode made a valid tool call (known tool, JSON arguments ``{"expression": ...}``,
  an expression the calculator evaluates) whose result is the correct answer, and then answered
  with a final message holding exactly one number, equal to the correct answer.
- **0.2**: a valid tool call was made, but the final answer is missing (empty, cut off by the
  token limit, or the turns ran out), wrong, or names more than one number (or the call computed
  something else and the model answered with that).
- **0.0**: no valid call (a malformed block, an unknown tool, prose, an answer guessed without the
  tool), whatever the final answer.

A right number without the tool scores 0, a list of numbers scores at most 0.2, and the tool only
returns what its expression computes, so the only way to 1.0 is to call the tool with the right
arithmetic and report its result.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

TOOL_NAME = "calculator"
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": TOOL_NAME,
            "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "for example 12 * 7"}},
                "required": ["expression"],
            },
        },
    }
]

_OPERATORS: dict[type[ast.AST], Callable[..., float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def calculate(expression: str) -> float:
    """``+ - * /`` and parentheses on numbers; anything else is a ValueError (no ``eval``)."""

    def value(node: ast.AST) -> float:
        number = node.value if isinstance(node, ast.Constant) else None
        if isinstance(number, int | float) and not isinstance(number, bool):  # True is no operand
            return number
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        raise ValueError("only numbers, + - * / and parentheses")

    if len(expression) > 100:
        raise ValueError("expression too long")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError("not an arithmetic expression") from None
    try:
        result = value(tree.body)
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    if abs(result) > 1e12:
        raise ValueError("result too large")
    return result


@dataclass(frozen=True)
class ToolResult:
    content: str  #: the ``role="tool"`` message's content
    valid: bool
    value: float | None = None


def run_tool(name: str, arguments: str) -> ToolResult:
    """Run one call as the model wrote it; a bad call gets an error back, as from a real tool."""
    try:
        if name != TOOL_NAME:
            raise ValueError(f"unknown tool {name!r}; the only tool is {TOOL_NAME!r}")
        args = json.loads(arguments or "{}")
        if not isinstance(args, dict) or not isinstance(args.get("expression"), str):
            raise ValueError('expected arguments {"expression": "<arithmetic>"}')
        result = calculate(args["expression"])
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:
        return ToolResult(json.dumps({"error": str(exc)}), False)
    shown = int(result) if float(result).is_integer() else round(result, 6)
    return ToolResult(json.dumps({"result": shown}), True, result)


# --------------------------------------------------------------------------- questions


@dataclass(frozen=True)
class Question:
    text: str
    answer: int
    kind: str


_WORDS = (
    ("A box holds {a} eggs.", "How many eggs are in {b} boxes?"),
    ("A bus has {a} seats.", "How many seats do {b} buses have?"),
    ("A pack has {a} pencils.", "How many pencils are in {b} packs?"),
    ("A shelf holds {a} books.", "How many books fit on {b} shelves?"),
    ("A ticket costs {a} dollars.", "How many dollars do {b} tickets cost?"),
    ("A crate holds {a} apples.", "How many apples are in {b} crates?"),
)
_UNITS = (
    ("grams", "kilograms", 1000),
    ("meters", "kilometers", 1000),
    ("minutes", "hours", 60),
    ("seconds", "minutes", 60),
    ("centimeters", "meters", 100),
    ("hours", "days", 24),
)


def make_question(kind: str, rng: random.Random) -> Question:
    a, b = rng.randint(11, 99), rng.randint(11, 99)
    if kind == "times":
        return Question(f"What is {a} * {b}?", a * b, kind)
    if kind == "words":
        first, second = rng.choice(_WORDS)
        return Question(f"{first.format(a=a)} {second.format(b=b)}", a * b, kind)
    if kind == "convert":
        small, big, factor = rng.choice(_UNITS)
        return Question(f"How many {small} are in {b} {big}?", b * factor, kind)
    raise ValueError(f"unknown kind {kind!r}")


KINDS = ("times", "words", "convert")


def questions(kinds: tuple[str, ...], n: int, seed: int) -> list[Question]:
    """``n`` questions, kinds taken in turn, the same for the same seed (no two with one text)."""
    rng = random.Random(seed)
    out: list[Question] = []
    seen: set[str] = set()
    for _ in range(100 * n):  # a kind has a few hundred distinct questions: ask for fewer
        if len(out) == n:
            break
        q = make_question(kinds[len(out) % len(kinds)], rng)
        if q.text not in seen:
            seen.add(q.text)
            out.append(q)
    if len(out) < n:
        raise ValueError(f"fewer than {n} distinct questions of kinds {kinds}")
    return out


# --------------------------------------------------------------------------- the reward


@dataclass
class Episode:
    """What the agent saw and did, for scoring: each tool call's result, and the final answer
    (None when the episode ended without one: out of turns, or cut off by the token limit)."""

    calls: list[ToolResult] = field(default_factory=list)
    final: str | None = None
    turns: int = 0


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def answer_numbers(text: str) -> list[float]:
    return [float(n) for n in _NUMBER.findall(text.replace(",", ""))]


def reward_parts(episode: Episode, answer: int) -> dict[str, float]:
    """The checks behind the reward, each 0 or 1 (kept as trajectory metrics)."""
    valid = [c for c in episode.calls if c.valid]
    numbers = answer_numbers(episode.final) if episode.final is not None else []
    return {
        "valid_call": float(bool(valid)),
        # isclose: "12 * 0.1 * 10000" computes 12000.000000000002 (the tool shows 12000.0)
        "right_call": float(any(c.value is not None and math.isclose(c.value, answer) for c in valid)),
        "answered": float(episode.final is not None and bool(episode.final.strip())),
        "correct": float(len(numbers) == 1 and numbers[0] == answer),
    }


def reward(episode: Episode, answer: int) -> float:
    parts = reward_parts(episode, answer)
    if not parts["valid_call"]:
        return 0.0
    if parts["right_call"] and parts["correct"]:
        return 1.0
    return 0.2
