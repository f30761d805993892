"""An LLM asked for JSON of a schema: the structured generation AutoRL's inputs and system prompt
and MCP•RL's scenarios share.

Any litellm model (or an OpenAI-compatible ``base_url``) answers with a JSON-schema response
format; the caller's ``check`` turns the parsed answer into the result or says what is wrong; a bad
answer is asked again once, with the reason; a second raises :class:`GenerationError`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

DEFAULT_GENERATOR_MODEL = "openai/gpt-4.1-mini"


class GenerationError(ValueError):
    """The generator's answer was unusable twice (malformed JSON, wrong shape or count)."""


def excerpt(text: str | None, limit: int = 300) -> str:
    """The start of a long answer, for an error message (how long it was, when cut)."""
    text = text or ""
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


async def generate_json(
    messages: list[dict[str, Any]],
    schema: dict[str, Any],
    check: Callable[[Any], T],
    *,
    schema_name: str,
    generator_model: str = DEFAULT_GENERATOR_MODEL,
    generator_api_key: str | None = None,
    generator_base_url: str | None = None,
    extra_litellm_params: dict[str, Any] | None = None,
    max_completion_tokens: int = 8000,
    what: str = "answer",
) -> T:
    """Ask ``generator_model`` for JSON matching ``schema``; ``check`` turns it into the result.

    ``check`` raises ``ValueError`` (or ``KeyError``/``TypeError``) saying what is wrong with a
    parsed answer. A malformed or rejected answer is asked again once, with the reason; a second
    bad answer raises :class:`GenerationError` naming the model, the reason and the answer's start.
    Transport errors (connection refused, 401...) are litellm's own and are not retried here.
    """
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no price-map download at import
    import litellm

    params: dict[str, Any] = {}
    if generator_base_url:
        params["api_base"] = generator_base_url
    if generator_api_key:
        params["api_key"] = generator_api_key
    elif generator_base_url:
        params["api_key"] = "none"  # an OpenAI-compatible server may need no key; litellm wants one
    params.update(extra_litellm_params or {})
    # model.litellm_completion_params() names the model too: it wins over generator_model.
    generator_model = params.pop("model", generator_model)
    if "max_tokens" in params:  # the caller's length limit, under either name, wins over ours
        params["max_completion_tokens"] = params.pop("max_tokens")
    conversation = list(messages)
    reason = ""
    content: str | None = None
    for attempt in (1, 2):
        response = await litellm.acompletion(
            model=generator_model,
            messages=conversation,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": schema_name, "schema": schema, "strict": True},
            },
            caching=False,
            **{"max_completion_tokens": max_completion_tokens, **params},
        )
        content = response.choices[0].message.content
        try:
            if not content:
                raise ValueError("the answer was empty")
            try:
                parsed = json.loads(content)
            except json.JSONDecodeError as exc:
                raise ValueError(f"the answer is not JSON ({exc.msg} at {exc.pos})") from None
            return check(parsed)
        except (ValueError, KeyError, TypeError) as exc:
            reason = str(exc) or type(exc).__name__
        if attempt == 1:
            conversation = [
                *messages,
                {"role": "assistant", "content": content or ""},
                {
                    "role": "user",
                    "content": f"That answer was rejected: {reason}. Answer again with only the JSON "
                    "object the schema describes, fixing that.",
                },
            ]
    raise GenerationError(
        f"the generator {generator_model} gave no usable {what} after 2 attempts: {reason}; "
        f"its last answer began {excerpt(content)!r}"
    )


def counted_list(answer: Any, key: str, count: int, item_shape: str) -> list:
    """``answer[key]`` when it is a list of exactly ``count`` items; else the ``ValueError`` that
    tells the generator what to fix (``item_shape`` shows one item, as in the schema)."""
    if not isinstance(answer, dict) or not isinstance(answer.get(key), list):
        raise ValueError(f'expected an object {{"{key}": [{item_shape}, ...]}}')
    items = answer[key]
    if len(items) != count:
        raise ValueError(f"expected exactly {count} {key}, got {len(items)}")
    return items
