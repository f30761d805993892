"""The chat template, rendered in one place for inference and the trainer.

The trainer must train each sampled turn on exactly the tokens the inference replica was prompted
with, or it trains on a prompt the model never saw. So neither renders a conversation itself: the
inference service turns a request into its prompt with ``ChatInput.prompt_token_ids``, and the
trainer turns the conversation before each sampled turn into that turn's prompt with the same
call (``ChatInput.before(i).prompt_token_ids``). What differs between them is only where the
messages come from (an HTTP request, a stored trajectory), and both kinds are duck-typed here: the
OpenAI request types of the inference API and the wire types of ``schemas`` have the same fields.

What the template is given:

- each message's content as text (a message with a non-text part is refused: ``UnsupportedContent``);
- tool-call arguments parsed into objects where they are JSON objects (templates write
  ``arguments | tojson``, which would quote a JSON string twice); arguments nesting deeper than
  ``codec.MAX_NESTING`` are refused (``ChatTemplateError``) before they are parsed, since parsing
  and ``tojson`` recurse once per level;
- tools without ``null`` fields for a template to print;
- the caller's template variables (``chat_template_kwargs``), which may not name an argument the
  renderer sets itself, nor replace the template (``RESERVED``): refused on both sides alike.

A template that raises (roles must alternate, an unknown filter) raises ``ChatTemplateError``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from artery.shared.codec import MAX_NESTING, json_nesting_exceeds

#: Arguments of ``apply_chat_template`` that template variables may not set: those the renderer
#: sets itself, and the template: a client's Jinja would run in the replica (vLLM, too, refuses a
#: request's template unless told to trust it).
RESERVED = frozenset(
    {
        "tools",
        "add_generation_prompt",
        "tokenize",
        "return_dict",
        "return_assistant_tokens_mask",
        "chat_template",
    }
)


class ChatTemplateError(ValueError):
    """The template could not render the conversation (it raised, or was given a reserved name)."""


class UnsupportedContent(ValueError):
    """A message has a content part that is not text (an image): only text is rendered."""

    def __init__(self, index: int, part_type: str) -> None:
        super().__init__(f"only text content is supported, not {part_type!r}")
        self.index = index
        self.part_type = part_type


# --------------------------------------------------------------------------- template input


def tool_call_arguments(arguments: str | dict[str, Any], index: int = 0) -> Any:
    """Arguments as an object when they are a JSON object; invalid JSON the model wrote stays a
    string (that is data, not an error). Arguments nesting deeper than ``MAX_NESTING`` are a
    ``ChatTemplateError`` naming message ``index``."""
    if isinstance(arguments, dict):
        return arguments
    if json_nesting_exceeds(arguments):
        raise ChatTemplateError(
            f"messages[{index}]: tool-call arguments nest deeper than the limit of {MAX_NESTING}"
        )
    try:
        parsed = json.loads(arguments)
    except (ValueError, RecursionError):  # RecursionError: malformed nesting the scan let through
        return arguments
    return parsed if isinstance(parsed, dict) else arguments


def render_tool_calls(tool_calls: Iterable[Any], index: int = 0) -> list[dict[str, Any]]:
    return [
        {
            "id": call.id,
            "type": "function",
            "function": {
                "name": call.function.name,
                "arguments": tool_call_arguments(call.function.arguments, index),
            },
        }
        for call in tool_calls
    ]


def _part_text(part: Any) -> str | None:
    """A text part's text, None for any other part. The request's parts say their ``type``; the
    wire types are one class per kind (the tag is not an attribute), and only ``TextPart`` has
    ``text``."""
    if getattr(part, "type", "text") != "text":
        return None
    text = getattr(part, "text", None)
    return text if isinstance(text, str) else None


def message_text(message: Any, index: int = 0) -> str:
    """The message's content as one text; ``index`` names the message in the error."""
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        text = _part_text(part)
        if text is None:
            raise UnsupportedContent(index, str(getattr(part, "type", None) or type(part).__name__))
        texts.append(text)
    return "".join(texts)


def render_message(message: Any, index: int = 0) -> dict[str, Any]:
    """One message as the template receives it."""
    rendered: dict[str, Any] = {"role": message.role, "content": message_text(message, index)}
    for key in ("name", "tool_call_id", "reasoning_content"):
        if getattr(message, key, None) is not None:
            rendered[key] = getattr(message, key)
    if message.tool_calls:
        rendered["tool_calls"] = render_tool_calls(message.tool_calls, index)
    return rendered


def render_tools(tools: Sequence[Any] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    return [
        {
            "type": tool.type,
            "function": {k: v for k, v in msgspec.structs.asdict(tool.function).items() if v is not None},
        }
        for tool in tools
    ]


# --------------------------------------------------------------------------- rendering


@dataclass(frozen=True)
class ChatInput:
    """A conversation as the chat template receives it: plain messages, tools and variables."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    variables: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def of(
        cls,
        messages: Sequence[Any],
        tools: Sequence[Any] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> ChatInput:
        """From request or wire messages and tools. Raises ``UnsupportedContent`` and, for a
        variable named in ``RESERVED`` or tool-call arguments nested too deeply, ``ChatTemplateError``."""
        variables = dict(chat_template_kwargs or {})
        clash = sorted(RESERVED & variables.keys())
        if clash:
            raise ChatTemplateError(f"chat_template_kwargs may not set {', '.join(clash)}")
        rendered = [render_message(message, i) for i, message in enumerate(messages)]
        return cls(messages=rendered, tools=render_tools(tools), variables=variables)

    def before(self, index: int) -> ChatInput:
        """The conversation up to (not including) message ``index``: what a turn was prompted with."""
        return ChatInput(messages=self.messages[:index], tools=self.tools, variables=self.variables)

    def text(self, tokenizer: Any, *, add_generation_prompt: bool) -> str:
        return self._apply(tokenizer, add_generation_prompt=add_generation_prompt, tokenize=False)

    def prompt_token_ids(self, tokenizer: Any) -> list[int]:
        """The prompt an engine continues: the conversation and the template's generation prompt."""
        return token_ids(self._apply(tokenizer, add_generation_prompt=True, tokenize=True))

    def token_ids_and_assistant_mask(self, tokenizer: Any) -> tuple[list[int], list[int]]:
        """The whole conversation's ids, and 1 on the tokens inside the template's
        ``{% generation %}`` blocks (all 0 for a template without them)."""
        encoding = self._apply(
            tokenizer,
            add_generation_prompt=False,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
        )
        return token_ids(encoding), [int(bit) for bit in encoding["assistant_masks"]]

    def _apply(self, tokenizer: Any, **arguments: Any) -> Any:
        try:
            return tokenizer.apply_chat_template(
                self.messages, tools=self.tools, **{**self.variables, **arguments}
            )
        except Exception as exc:  # the template's own error (jinja2's, a raise_exception) is data
            raise ChatTemplateError(f"{type(exc).__name__}: {exc}") from exc


def token_ids(rendered: Any) -> list[int]:
    """Token ids from what ``apply_chat_template`` returns: a BatchEncoding (transformers 5's
    default), a list of ids, or a batch of one."""
    if isinstance(rendered, Mapping):
        rendered = rendered["input_ids"]
    if hasattr(rendered, "tolist"):
        rendered = rendered.tolist()
    if rendered and isinstance(rendered[0], Sequence):
        rendered = rendered[0]
    return [int(token) for token in rendered]
