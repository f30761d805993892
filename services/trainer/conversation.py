"""One conversation to token ids, a mask of trained tokens and old logprobs (``tokenize_conversation``).

A trained assistant message with a ``sample`` (engine output) is trained on exactly what the
engine saw and produced: the prompt is rendered by ``ChatInput.prompt_token_ids`` from the
messages before it, the call the inference service made for that turn (``shared.chat_template``),
and the sample's token ids and logprobs follow it verbatim. A trained message without a sample
(``allow_training_without_logprobs``, ``trainable=True``, SFT) is the template's rendering of the
conversation up to and including it, trained inside its ``{% generation %}`` block, with NaN old
logprobs (the loss then uses the new ones: ratio 1).

Turns are merged into one sequence while each turn's tokens continue the previous turn's: the
engine's prompt for a later turn holds the earlier turns as the template re-renders them from the
parsed message, which is the sampled tokens only when the sample re-tokenises to itself. Where it
does not (the model wrote a tool call with other spacing than the template's ``tojson``, a sample
cut by ``max_tokens`` without its end token, a template that drops earlier reasoning), the
conversation is split: the later turn starts a sequence of its own with its own prompt. Every
sequence is then tokens the engine really saw, and every sampled token is trained exactly once.

The conversation is cut after the last trained message. The prompt is what the engine saw
provided the agent sent the conversation back as the trajectory stores it.

The rollouts of a group are usually sampled from one prompt: ``Prompts`` renders each distinct
prompt once per step instead of once per rollout (the chat template is most of the preparation's
time).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from artery.schemas import Message, Tool
from artery.shared.chat_template import ChatInput, ChatTemplateError, UnsupportedContent

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

NAN = float("nan")

DropReason = Literal[
    "zero_advantage",  # the whole trajectory: its advantage is exactly 0
    "no_trainable_message",  # the conversation has no assistant message to train on
    "no_trained_tokens",  # trained messages, but no token to train (an empty sample)
    "too_long",  # longer than max_seq_len, and no trained token within it
    "unsupported_content",  # image parts: only text is trained on
    "bad_sample",  # a sample whose logprobs do not match its token ids, or ids out of the vocabulary
    "template",  # the chat template could not render the conversation, or has no generation markers
]


class SequenceError(ValueError):
    def __init__(self, reason: DropReason, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason: DropReason = reason
        self.detail = detail


@dataclass(frozen=True, kw_only=True)
class Tokens:
    """Aligned on tokens (not shifted): ``assistant_mask[t]`` and ``logprobs[t]`` are about
    ``input_ids[t]``."""

    input_ids: list[int]
    assistant_mask: list[int]
    logprobs: list[float]


class Prompts:
    """Prompt token ids by the chat input they were rendered from, for one step's conversations.

    The key is the input's JSON: equal JSON is an equal input for the template, which sees only
    JSON-shaped values. An input JSON cannot encode is rendered each time, never cached."""

    def __init__(self) -> None:
        self._ids: dict[bytes, list[int]] = {}

    def token_ids(self, chat: ChatInput, tokenizer: Any) -> list[int]:
        try:
            key = msgspec.json.encode((chat.messages, chat.tools, chat.variables))
        except (TypeError, msgspec.EncodeError):
            return _render(chat.prompt_token_ids, tokenizer)
        ids = self._ids.get(key)
        if ids is None:
            ids = self._ids[key] = _render(chat.prompt_token_ids, tokenizer)
        return ids


def is_trainable(message: Message, allow_training_without_logprobs: bool = False) -> bool:
    if message.role != "assistant":
        return False
    if message.trainable is not None:
        return message.trainable
    return message.sample is not None or allow_training_without_logprobs


def tokenize_conversation(
    messages: Sequence[Message],
    tools: Sequence[Tool] | None,
    tokenizer: PreTrainedTokenizerBase,
    *,
    allow_training_without_logprobs: bool = False,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    prompts: Prompts | None = None,
) -> list[Tokens]:
    """The conversation's sequences (one, or several where a turn does not continue the tokens
    before it), untruncated. Raises ``SequenceError``. ``prompts``: shared with the step's other
    conversations (None: this one's own)."""
    prompts = Prompts() if prompts is None else prompts
    trained = [i for i, m in enumerate(messages) if is_trainable(m, allow_training_without_logprobs)]
    if not trained:
        raise SequenceError("no_trainable_message")
    messages = list(messages[: trained[-1] + 1])
    try:
        chat = ChatInput.of(messages, tools, chat_template_kwargs)
    except UnsupportedContent as exc:
        raise SequenceError("unsupported_content", str(exc)) from exc
    except ChatTemplateError as exc:
        raise SequenceError("template", str(exc)) from exc

    parts: list[Tokens] = []
    for i in trained:
        if messages[i].sample is not None:
            turn = _sampled_turn(chat, messages[i], i, tokenizer, prompts)
        else:
            turn = _template_turn(chat, messages, i, tokenizer)
        if parts and _continues(turn, parts[-1]):
            parts[-1] = _extend(parts[-1], turn)
        else:
            parts.append(turn)
    return parts


def _render(render: Callable[..., Any], *args: Any) -> Any:
    try:
        return render(*args)
    except ChatTemplateError as exc:
        raise SequenceError("template", str(exc)) from exc


def _sampled_turn(chat: ChatInput, message: Message, index: int, tokenizer: Any, prompts: Prompts) -> Tokens:
    """The turn's prompt, as the inference service rendered it, and the sample verbatim."""
    sample = message.sample
    assert sample is not None
    check_sample(message, len(tokenizer))
    prompt = prompts.token_ids(chat.before(index), tokenizer)
    return Tokens(
        input_ids=[*prompt, *sample.token_ids],
        assistant_mask=[0] * len(prompt) + [1] * len(sample.token_ids),
        logprobs=[NAN] * len(prompt) + [float(lp) for lp in sample.logprobs],
    )


def _template_turn(chat: ChatInput, messages: Sequence[Message], index: int, tokenizer: Any) -> Tokens:
    """The conversation through message ``index``, trained on that message's generation block."""
    ids, generation = _render(chat.before(index + 1).token_ids_and_assistant_mask, tokenizer)
    runs = _runs(generation)
    assistants = sum(m.role == "assistant" for m in messages[: index + 1])
    if len(runs) != assistants:
        raise SequenceError(
            "template",
            f"{len(runs)} generation blocks for {assistants} assistant messages "
            "(does the chat template have {% generation %} markers?)",
        )
    run = runs[-1]
    return Tokens(
        input_ids=ids[: run.stop],
        assistant_mask=[0] * run.start + [1] * len(run),
        logprobs=[NAN] * run.stop,
    )


def _continues(turn: Tokens, before: Tokens) -> bool:
    """Whether ``turn``'s tokens start with all of ``before``'s (so one sequence holds both)."""
    n = len(before.input_ids)
    return len(turn.input_ids) >= n and turn.input_ids[:n] == before.input_ids


def _extend(before: Tokens, turn: Tokens) -> Tokens:
    n = len(before.input_ids)
    return Tokens(
        input_ids=turn.input_ids,
        assistant_mask=before.assistant_mask + turn.assistant_mask[n:],
        logprobs=before.logprobs + turn.logprobs[n:],
    )


def _runs(mask: Sequence[int]) -> list[range]:
    """The maximal runs of 1s: one per assistant message's ``{% generation %}`` block."""
    runs, start = [], None
    for i, bit in enumerate([*mask, 0]):
        if bit and start is None:
            start = i
        elif not bit and start is not None:
            runs.append(range(start, i))
            start = None
    return runs


def check_sample(message: Message, vocab_size: int) -> None:
    sample = message.sample
    assert sample is not None
    if len(sample.token_ids) != len(sample.logprobs):
        raise SequenceError(
            "bad_sample", f"{len(sample.token_ids)} token ids, {len(sample.logprobs)} logprobs"
        )
    if any(not 0 <= t < vocab_size for t in sample.token_ids):
        raise SequenceError("bad_sample", "token id outside the vocabulary")
    if any(not math.isfinite(lp) for lp in sample.logprobs):
        raise SequenceError("bad_sample", "a logprob is not finite")


def fit_length(tokens: Tokens, max_seq_len: int) -> Tokens:
    """Cut from the right to ``max_seq_len``; raises when no trained token would remain.

    A token is trainable only from position 1 on (position 0 is never predicted).
    """
    if not any(tokens.assistant_mask[1:]):
        raise SequenceError("no_trained_tokens")
    if len(tokens.input_ids) <= max_seq_len:
        return tokens
    if not any(tokens.assistant_mask[1:max_seq_len]):
        raise SequenceError("too_long", f"{len(tokens.input_ids)} tokens, no trained token in {max_seq_len}")
    return Tokens(
        input_ids=tokens.input_ids[:max_seq_len],
        assistant_mask=tokens.assistant_mask[:max_seq_len],
        logprobs=tokens.logprobs[:max_seq_len],
    )
