"""From what agent code holds (OpenAI dicts, OpenAI ``Choice`` objects) to wire ``Message``s.

A ``Choice`` is engine output: its token ids and logprobs become the message's ``Sample`` so the
trainer uses exactly what was sampled. Token ids come from the choice's ``token_ids`` (Artery's
inference service returns them) or from vLLM's ``token_id:N`` token strings. Logprobs come from
the standard ``logprobs.content`` when the client asked for them, else from Artery's
``token_logprobs``, which its inference service sends with every choice: ART's agents never ask
for logprobs (ART's server forces them), and their completions train all the same. Without
either the message is still marked trainable and the trainer re-tokenises it.
"""

from __future__ import annotations

from typing import Any

import msgspec

from artery.schemas import Message, Sample, TopLogprob


def _as_dict(obj: Any) -> Any:
    """pydantic models (openai types) to plain dicts, leaving everything else as it is."""
    if hasattr(obj, "model_dump"):
        return obj.model_dump(exclude_none=True)
    return obj


def is_choice(item: Any) -> bool:
    if isinstance(item, Message):
        return False
    data = item if isinstance(item, dict) else getattr(item, "__dict__", {})
    return ("message" in data and "finish_reason" in data) or hasattr(item, "finish_reason")


def _token_id(token: str) -> int | None:
    if token.startswith("token_id:"):
        try:
            return int(token.removeprefix("token_id:"))
        except ValueError:
            return None
    return None


def choice_to_message(choice: Any) -> Message:
    data = _as_dict(choice)
    message = dict(_as_dict(data.get("message") or {}))
    message.setdefault("role", "assistant")
    for key in ("refusal", "audio", "annotations", "function_call"):
        message.pop(key, None)
    content = ((data.get("logprobs") or {}).get("content")) or []
    logprobs = [float(entry["logprob"]) for entry in content]
    token_ids = _artery_field(data, choice, "token_ids")
    if token_ids is None and content:
        parsed = [_token_id(entry.get("token", "")) for entry in content]
        token_ids = parsed if all(t is not None for t in parsed) else None
    if not logprobs:  # not asked for: Artery's own copy, sent with every choice
        logprobs = [float(lp) for lp in _artery_field(data, choice, "token_logprobs") or []]
    sample = None
    if logprobs and token_ids is not None and len(token_ids) == len(logprobs):
        top = [
            [
                TopLogprob(
                    token=t["token"],
                    logprob=float(t["logprob"]),
                    token_id=t.get("token_id", _token_id(t["token"])),
                )
                for t in entry.get("top_logprobs") or []
            ]
            for entry in content
        ]
        sample = Sample(
            token_ids=list(token_ids),
            logprobs=logprobs,
            top_logprobs=top if any(top) else None,
            finish_reason=data.get("finish_reason"),
            served_model=_served_model(_artery_field(data, choice, "served_model")),
        )
    wire = msgspec.convert(message, Message)
    wire.sample = sample
    wire.trainable = True
    if wire.content is None and not wire.tool_calls:
        wire.content = ""  # as ART does: an empty answer is still an answer
    return wire


def _served_model(value: Any) -> str | None:
    """``<model>@<step>`` of the policy that sampled the choice (Artery's inference says so)."""
    return value if isinstance(value, str) else None


def _artery_field(data: dict[str, Any], choice: Any, name: str) -> Any:
    """One of the extra fields Artery's inference adds to a choice, wherever the client kept it:
    in the choice itself (a dict, or the OpenAI client's ``model_extra``) or, for litellm's
    ``Choices``, in its ``provider_specific_fields``."""
    extra = getattr(choice, "model_extra", None) or {}
    provider = data.get("provider_specific_fields") or {}
    for found in (
        data.get(name),
        extra.get(name),
        provider.get(name) if isinstance(provider, dict) else None,
    ):
        if found:  # an empty list is no more than a missing one
            return found
    return None


def to_message(item: Any) -> Message:
    """One element of ``messages_and_choices`` as a wire ``Message`` (validated)."""
    if isinstance(item, Message):
        return item
    if is_choice(item):
        return choice_to_message(item)
    try:
        return msgspec.convert(_as_dict(item), Message)
    except msgspec.ValidationError as exc:
        raise ValueError(f"not a chat message: {exc}") from exc


def to_messages(items: list[Any]) -> list[Message]:
    return [to_message(item) for item in items]
