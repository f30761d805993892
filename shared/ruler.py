"""RULER's core: an LLM judge scores message lists relative to each other.

Same shape as ART's ``art.rewards.ruler``: the lists' shared message prefix is sent once as context,
each list's remainder is labelled ``<trajectory id="i">``, and the judge returns, per id, an
explanation and a score in [0, 1]. Unlike ART 0.5.18 the scores are matched by id (not position),
clamped to [0, 1] and validated; a malformed answer is asked again before giving up.

Plain messages in, scores out: both the SDK (``artery.rewards``, RULER in the agent's process)
and the reward service call it, so it lives here, below both, and knows neither.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from typing import Any

import msgspec

from artery.shared.codec import MAX_NESTING, json_nesting_exceeds

log = logging.getLogger(__name__)

DEFAULT_RUBRIC = """
- A trajectory that achieves its goal should always get a significantly higher score than a trajectory that does not achieve its goal.
- A trajectory that achieves its goal more efficiently (eg. by avoiding unproductive detours) should get a higher score than a trajectory that achieves its goal less efficiently.
- If one trajectory is only slightly better than another, the difference in scores should be small. If it is significantly better, the difference in scores should be large.
- You may give some partial credit for a trajectory that makes progress towards its goal but does not complete it.
"""  # noqa: E501

SYSTEM_PROMPT = (
    "All of the trajectories below have been given the same goal. Your job is to consider each of them "
    "and give them a score between 0 and 1. Take into consideration your best judgement of the agent's "
    "goal.\n\nGrading standards:\n{rubric}"
)

RESPONSE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "scores": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "trajectory_id": {"type": "string"},
                    "explanation": {"type": "string", "description": "A short description of the score."},
                    "score": {"type": "number", "description": "A score between 0 and 1."},
                },
                "required": ["trajectory_id", "explanation", "score"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["scores"],
    "additionalProperties": False,
}

RESPONSE_FORMAT: dict[str, Any] = {
    "type": "json_schema",
    "json_schema": {"name": "Response", "schema": RESPONSE_SCHEMA, "strict": True},
}


class RulerError(ValueError):
    """The judge's answer could not be turned into one score per trajectory."""


@dataclass
class TrajectoryScore:
    trajectory_id: str
    explanation: str
    score: float


def common_prefix_len(message_lists: list[list[Any]]) -> int:
    """Number of leading messages equal (``==``) across all the lists."""
    if not message_lists:
        return 0
    n = 0
    shortest = min(len(m) for m in message_lists)
    while n < shortest and all(m[n] == message_lists[0][n] for m in message_lists[1:]):
        n += 1
    return n


def _all_identical(message_lists: list[list[Any]], prefix_len: int) -> bool:
    return all(len(m) == prefix_len for m in message_lists)


def _plain(obj: Any) -> Any:
    """OpenAI SDK objects (pydantic) as dicts, recursively; everything else as it is."""
    if hasattr(obj, "model_dump"):
        return obj.model_dump(exclude_none=True)
    if isinstance(obj, list | tuple):
        return [_plain(item) for item in obj]
    if isinstance(obj, dict):
        return {key: _plain(value) for key, value in obj.items()}
    return obj


def _jsonable(obj: Any) -> Any:
    return msgspec.to_builtins(_plain(obj))


def build_judge_messages(
    message_lists: list[list[Any]], rubric: str = DEFAULT_RUBRIC, tools: list[Any] | None = None
) -> list[dict[str, str]]:
    """The system and user messages sent to the judge, in ART's format."""
    prefix_len = common_prefix_len(message_lists)
    identical = _all_identical(message_lists, prefix_len)
    if identical:
        # Every trajectory is the same conversation: score it once, in full.
        prefix, remainders = [], [message_lists[0]]
    else:
        prefix = message_lists[0][:prefix_len]
        remainders = [m[prefix_len:] for m in message_lists]
    user = ""
    if prefix:
        user += "<context>\n" + json.dumps(_jsonable(prefix)) + "\n</context>\n\n"
    if tools:
        user += "<available_tools>\n" + json.dumps(_jsonable(list(tools))) + "\n</available_tools>\n\n"
    blocks = [
        f'<trajectory id="{i}">\n' + json.dumps(_jsonable(rest)) + "\n</trajectory>"
        for i, rest in enumerate(remainders, start=1)
    ]
    user += "Trajectories:\n\n" + "\n\n".join(blocks)
    return [
        {"role": "system", "content": SYSTEM_PROMPT.format(rubric=rubric)},
        {"role": "user", "content": user},
    ]


def _excerpt(value: Any, limit: int = 500) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def parse_scores(answer: str | dict[str, Any], n: int) -> list[TrajectoryScore]:
    """Scores for trajectories ``"1".."n"``, in that order, matched by id and clamped to [0, 1]."""
    data: Any = answer
    if isinstance(answer, (str, bytes)):
        if json_nesting_exceeds(answer):  # json.loads recurses once per level
            raise RulerError(f"judge answer nests deeper than {MAX_NESTING}: {_excerpt(answer)}")
        try:
            data = json.loads(answer)
        except (json.JSONDecodeError, TypeError, RecursionError) as exc:
            raise RulerError(f"judge answer is not valid JSON ({exc}): {_excerpt(answer)}") from None
    if not isinstance(data, dict) or not isinstance(data.get("scores"), list):
        raise RulerError(f'judge answer has no "scores" list: {_excerpt(answer)}')
    expected = {str(i) for i in range(1, n + 1)}
    by_id: dict[str, TrajectoryScore] = {}
    for item in data["scores"]:
        if not isinstance(item, dict):
            raise RulerError(f"judge score entry is not an object: {_excerpt(item)}")
        tid = str(item.get("trajectory_id", "")).strip()
        if tid not in expected:
            raise RulerError(f"judge scored unknown trajectory id {tid!r} (expected 1..{n})")
        if tid in by_id:
            raise RulerError(f"judge scored trajectory id {tid!r} more than once")
        raw = item.get("score")
        if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
            raise RulerError(f"judge score for trajectory {tid} is not a number: {raw!r}")
        try:
            score = float(raw)
        except ValueError:
            raise RulerError(f"judge score for trajectory {tid} is not a number: {raw!r}") from None
        if not math.isfinite(score):
            raise RulerError(f"judge score for trajectory {tid} is not finite: {raw!r}")
        explanation = item.get("explanation", "")
        by_id[tid] = TrajectoryScore(
            trajectory_id=tid,
            explanation=explanation if isinstance(explanation, str) else str(explanation),
            score=min(1.0, max(0.0, score)),
        )
    missing = sorted(expected - by_id.keys(), key=int)
    if missing:
        raise RulerError(f"judge returned {len(by_id)} scores for {n} trajectories; missing ids {missing}")
    return [by_id[str(i)] for i in range(1, n + 1)]


@dataclass
class Judgement:
    """A judge's scores for a list of trajectories, with what obtaining them cost."""

    scores: list[TrajectoryScore]
    attempts: int
    prompt_tokens: int = 0
    completion_tokens: int = 0
    #: USD, from litellm's price table; ``None`` when the model's price is unknown (a local judge).
    cost_usd: float | None = None


def _call_cost(litellm: Any, response: Any) -> float | None:
    try:
        return float(litellm.completion_cost(completion_response=response))
    except Exception:  # unknown model or provider: the cost is unknown, not zero
        return None


async def ruler_judgement(
    message_lists: list[list[Any]],
    judge_model: str = "openai/o3",
    extra_litellm_params: dict[str, Any] | None = None,
    rubric: str = DEFAULT_RUBRIC,
    tools: list[Any] | None = None,
    *,
    max_attempts: int = 2,
) -> Judgement:
    """Like :func:`ruler`, and also report the judge calls' tokens and cost."""
    if not message_lists:
        return Judgement(scores=[], attempts=0)
    import litellm  # heavy import, only when a judge is actually called

    prefix_len = common_prefix_len(message_lists)
    identical = _all_identical(message_lists, prefix_len)
    if identical:
        log.warning("all %d trajectories are identical; RULER scores one of them", len(message_lists))
    n = 1 if identical else len(message_lists)
    messages = build_judge_messages(message_lists, rubric, tools)
    usage = Judgement(scores=[], attempts=0, cost_usd=0.0)
    last_error: RulerError | None = None
    for attempt in range(1, max(1, max_attempts) + 1):
        response = await litellm.acompletion(
            model=judge_model,
            messages=messages,
            response_format=RESPONSE_FORMAT,
            caching=False,
            **(extra_litellm_params or {}),
        )
        usage.attempts = attempt
        tokens = getattr(response, "usage", None)
        usage.prompt_tokens += int(getattr(tokens, "prompt_tokens", 0) or 0)
        usage.completion_tokens += int(getattr(tokens, "completion_tokens", 0) or 0)
        cost = _call_cost(litellm, response)
        usage.cost_usd = None if cost is None or usage.cost_usd is None else usage.cost_usd + cost
        content = response.choices[0].message.content or ""
        try:
            scores = parse_scores(content, n)
        except RulerError as exc:
            last_error = exc
            log.warning("RULER judge answer rejected (attempt %d/%d): %s", attempt, max_attempts, exc)
            continue
        if identical:
            only = scores[0]
            scores = [
                TrajectoryScore(str(i), only.explanation, only.score)
                for i in range(1, len(message_lists) + 1)
            ]
        usage.scores = scores
        return usage
    raise RulerError(f"RULER judge {judge_model} failed after {max_attempts} attempts: {last_error}")


async def ruler(
    message_lists: list[list[Any]],
    judge_model: str = "openai/o3",
    extra_litellm_params: dict[str, Any] | None = None,
    rubric: str = DEFAULT_RUBRIC,
    tools: list[Any] | None = None,
    *,
    max_attempts: int = 2,
) -> list[TrajectoryScore]:
    """Score each message list relative to the others with an LLM judge, one score per list."""
    judgement = await ruler_judgement(
        message_lists, judge_model, extra_litellm_params, rubric, tools, max_attempts=max_attempts
    )
    return judgement.scores
