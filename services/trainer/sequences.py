"""Stored trajectories become training sequences: token ids, a mask of trained tokens, old logprobs.

Rules, as ART's tokenizer:

- Each conversation (the trajectory's messages, and each of its ``additional_histories``) becomes its
  own sequence with the trajectory's advantage; a trajectory whose advantage is exactly zero gives
  none (its group had equal rewards, or it scored exactly the mean).
- An assistant message is trained when ``trainable`` is True, or when it is unset and the message has
  a ``sample`` (engine output); without a sample only with ``allow_training_without_logprobs``. The
  conversation is cut after the last trained message; one with no trained message gives no sequence.
- The conversation is rendered with the tokenizer's chat template (tools included). Where a trained
  message has a ``sample``, its exact sampled token ids and logprobs replace the template's rendering
  of that message, so training uses what was sampled, not a re-tokenisation.
- Trained messages without a sample keep the template's tokens inside its ``{% generation %}`` block,
  with NaN old logprobs (the loss then uses the new ones: ratio 1). Everything else has mask 0.
- A sequence longer than ``max_seq_len`` is cut from the right when a trained token survives, else
  dropped. Every cut and drop is reported with its reason.

How the splice works (the sentinel trick, done on character offsets): each sampled message is
rendered with a placeholder string as its content (its tool calls and reasoning removed, since the
sampled tokens already contain them). The placeholder's character span in the rendered text is
mapped to tokens through the fast tokenizer's offsets; if a token straddles its edge (the tokenizer
merged it with the template's text) the conversation is dropped with reason ``template`` rather
than spliced wrongly. The placeholder's tokens are replaced by the sampled ones; when the sample
ends with the special end token that the template writes right after the content (``<|im_end|>``:
the engine returns the stop token among the sampled ids), the template's copy is removed. The
tokens before a sampled message are then what the engine was prompted with, provided the agent
sent the conversation back unchanged.

Context stays as the template renders it: an assistant message that is not trained (or a trained one
before it) is rendered by the template even if it has a sample, because that is what the engine was
prompted with on the later turns. Thinking templates that render a reasoning block of their own
around the content (Qwen3) are not special-cased.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor

from artery.schemas import Message, TextPart, Tool, Trajectory
from artery.shared.chat_template import render_message, render_tools

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
    "template",  # the chat template or tokenizer could not be spliced reliably
]


@dataclass(frozen=True, kw_only=True)
class TrainingSequence:
    """One conversation, ready to pad. The lists are aligned on tokens (not shifted)."""

    input_ids: list[int]
    #: 1 where the token at this position is trained.
    assistant_mask: list[int]
    #: The sampler's logprob of the token at this position; NaN where unknown.
    old_logprobs: list[float]
    advantage: float
    group_index: int
    trajectory_index: int
    #: 0 for the trajectory's messages, i for ``additional_histories[i - 1]``.
    history_index: int = 0


@dataclass(frozen=True, kw_only=True)
class Dropped:
    group_index: int
    trajectory_index: int
    #: None when the whole trajectory was skipped (zero advantage).
    history_index: int | None
    reason: DropReason
    detail: str = ""


@dataclass(frozen=True, kw_only=True)
class Cut:
    group_index: int
    trajectory_index: int
    history_index: int
    length: int
    kept: int


@dataclass(frozen=True, kw_only=True)
class SequenceReport:
    trajectories: int
    #: Trajectories that gave at least one sequence.
    used: int
    sequences: int
    cut: tuple[Cut, ...] = ()
    dropped: tuple[Dropped, ...] = ()

    def counts(self) -> dict[str, int]:
        """Flat counters for metrics: ``dropped/<reason>`` for each reason that occurred."""
        reasons = Counter(d.reason for d in self.dropped)
        return {
            "trajectories": self.trajectories,
            "trajectories_used": self.used,
            "sequences": self.sequences,
            "sequences_cut": len(self.cut),
            **{f"dropped/{reason}": n for reason, n in sorted(reasons.items())},
        }


class SequenceError(ValueError):
    def __init__(self, reason: DropReason, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason: DropReason = reason
        self.detail = detail


@dataclass(frozen=True, kw_only=True)
class Tokens:
    input_ids: list[int]
    assistant_mask: list[int]
    logprobs: list[float]


# --------------------------------------------------------------------------- one conversation


def is_trainable(message: Message, allow_training_without_logprobs: bool = False) -> bool:
    if message.role != "assistant":
        return False
    if message.trainable is not None:
        return message.trainable
    return message.sample is not None or allow_training_without_logprobs


def placeholder(index: int) -> str:
    """Letters and digits only, so that byte-level BPE splits it from the template's newlines."""
    return f"ArterySplice{index}Placeholder"


def template_message(message: Message, content: str | None = None) -> dict[str, Any]:
    """The message as the inference service hands it to the chat template, so the context renders
    to the tokens the engine was prompted with. ``content`` replaces the content, its tool calls
    and its reasoning (a splice placeholder)."""
    if content is None:
        return render_message(message, _text(message))
    return render_message(message, content, placeholder=True)


def template_tools(tools: Sequence[Tool] | None) -> list[dict[str, Any]] | None:
    """Tools as the inference service renders them."""
    return render_tools(tools)


def _text(message: Message) -> str:
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    if any(not isinstance(part, TextPart) for part in message.content):
        raise SequenceError("unsupported_content", "only text content can be trained on")
    return "".join(part.text for part in message.content if isinstance(part, TextPart))


def _token_span(encoding: Any, text: str, marker: str) -> tuple[int, int]:
    """The tokens [start, end) that cover exactly ``marker`` in ``text``."""
    start_char = text.find(marker)
    if start_char < 0 or text.find(marker, start_char + 1) >= 0:
        raise SequenceError("template", "the splice placeholder is not rendered exactly once")
    end_char = start_char + len(marker)
    first, last = encoding.char_to_token(start_char), encoding.char_to_token(end_char - 1)
    if first is None or last is None:
        raise SequenceError("template", "the splice placeholder has no tokens")
    if encoding.token_to_chars(first).start != start_char or encoding.token_to_chars(last).end != end_char:
        raise SequenceError("template", "the tokenizer merged the splice placeholder with its neighbours")
    return first, last + 1


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


def _special_ids(tokenizer: PreTrainedTokenizerBase) -> set[int]:
    added = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    return added | set(tokenizer.all_special_ids)


def _check_sample(message: Message, vocab_size: int) -> None:
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


def tokenize_conversation(
    messages: Sequence[Message],
    tools: Sequence[Tool] | None,
    tokenizer: PreTrainedTokenizerBase,
    *,
    allow_training_without_logprobs: bool = False,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> Tokens:
    """Render, splice and mask one conversation (untruncated). Raises ``SequenceError``."""
    trainable = [is_trainable(m, allow_training_without_logprobs) for m in messages]
    if not any(trainable):
        raise SequenceError("no_trainable_message")
    last = max(i for i, t in enumerate(trainable) if t)
    messages, trainable = list(messages[: last + 1]), trainable[: last + 1]
    markers = {i: placeholder(i) for i, m in enumerate(messages) if trainable[i] and m.sample is not None}
    for i in markers:
        _check_sample(messages[i], len(tokenizer))

    rendered = [template_message(m, markers.get(i)) for i, m in enumerate(messages)]
    kwargs: dict[str, Any] = {"tools": template_tools(tools), **(chat_template_kwargs or {})}
    try:
        text = tokenizer.apply_chat_template(rendered, tokenize=False, **kwargs)
        encoding = tokenizer.apply_chat_template(
            rendered, tokenize=True, return_dict=True, return_assistant_tokens_mask=True, **kwargs
        )
    except Exception as exc:  # a template raising on odd input (jinja2 errors) is data, not a crash
        raise SequenceError("template", f"{type(exc).__name__}: {exc}") from exc
    ids = list(encoding["input_ids"])
    mask = [0] * len(ids)
    logprobs = [NAN] * len(ids)

    unsampled = {i for i, m in enumerate(messages) if trainable[i] and i not in markers}
    if unsampled:
        assistants = [i for i, m in enumerate(messages) if m.role == "assistant"]
        runs = _runs(encoding["assistant_masks"])
        if len(runs) != len(assistants):
            raise SequenceError(
                "template",
                f"{len(runs)} generation blocks for {len(assistants)} assistant messages "
                "(does the chat template have {% generation %} markers?)",
            )
        for run, i in zip(runs, assistants, strict=True):
            if i in unsampled:
                mask[run.start : run.stop] = [1] * len(run)

    specials = _special_ids(tokenizer)
    for i in sorted(markers, reverse=True):  # right to left: earlier spans keep their positions
        start, end = _token_span(encoding, text, markers[i])
        sample = messages[i].sample
        assert sample is not None
        sampled = list(sample.token_ids)
        if sampled and end < len(ids) and ids[end] == sampled[-1] and ids[end] in specials:
            end += 1  # the template's end token duplicates the sampled stop token
        ids[start:end] = sampled
        mask[start:end] = [1] * len(sampled)
        logprobs[start:end] = [float(lp) for lp in sample.logprobs]
    return Tokens(input_ids=ids, assistant_mask=mask, logprobs=logprobs)


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


# --------------------------------------------------------------------------- trajectories


def trajectory_sequences(
    trajectory: Trajectory,
    advantage: float,
    tokenizer: PreTrainedTokenizerBase,
    *,
    max_seq_len: int,
    group_index: int = 0,
    trajectory_index: int = 0,
    allow_training_without_logprobs: bool = False,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> tuple[list[TrainingSequence], list[Cut], list[Dropped]]:
    """The sequences of one trajectory (its messages, then each additional history)."""
    where = {"group_index": group_index, "trajectory_index": trajectory_index}
    if advantage == 0.0:
        return [], [], [Dropped(**where, history_index=None, reason="zero_advantage")]
    conversations = [(trajectory.messages, trajectory.tools)]
    conversations += [(h.messages, h.tools) for h in trajectory.additional_histories]
    sequences: list[TrainingSequence] = []
    cuts: list[Cut] = []
    dropped: list[Dropped] = []
    for history_index, (messages, tools) in enumerate(conversations):
        try:
            full = tokenize_conversation(
                messages,
                tools,
                tokenizer,
                allow_training_without_logprobs=allow_training_without_logprobs,
                chat_template_kwargs=chat_template_kwargs,
            )
            tokens = fit_length(full, max_seq_len)
        except SequenceError as exc:
            dropped.append(
                Dropped(**where, history_index=history_index, reason=exc.reason, detail=exc.detail)
            )
            continue
        if len(tokens.input_ids) < len(full.input_ids):
            length, kept = len(full.input_ids), len(tokens.input_ids)
            cuts.append(Cut(**where, history_index=history_index, length=length, kept=kept))
        sequences.append(
            TrainingSequence(
                input_ids=tokens.input_ids,
                assistant_mask=tokens.assistant_mask,
                old_logprobs=tokens.logprobs,
                advantage=float(advantage),
                history_index=history_index,
                **where,
            )
        )
    return sequences, cuts, dropped


def build_sequences(
    groups: Sequence[Sequence[Trajectory]],
    advantages: Sequence[Sequence[float]],
    tokenizer: PreTrainedTokenizerBase,
    *,
    max_seq_len: int,
    allow_training_without_logprobs: bool = False,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> tuple[list[TrainingSequence], SequenceReport]:
    """Every group's trajectories, with one advantage per trajectory (``group_advantages``)."""
    sequences: list[TrainingSequence] = []
    cuts: list[Cut] = []
    dropped: list[Dropped] = []
    seen = used = 0
    for group_index, (group, group_adv) in enumerate(zip(groups, advantages, strict=True)):
        for trajectory_index, (trajectory, advantage) in enumerate(zip(group, group_adv, strict=True)):
            made, cut, drop = trajectory_sequences(
                trajectory,
                float(advantage),
                tokenizer,
                max_seq_len=max_seq_len,
                group_index=group_index,
                trajectory_index=trajectory_index,
                allow_training_without_logprobs=allow_training_without_logprobs,
                chat_template_kwargs=chat_template_kwargs,
            )
            seen += 1
            used += bool(made)
            sequences += made
            cuts += cut
            dropped += drop
    report = SequenceReport(
        trajectories=seen, used=used, sequences=len(sequences), cut=tuple(cuts), dropped=tuple(dropped)
    )
    return sequences, report


def sft_sequences(
    trajectories: Sequence[Trajectory],
    tokenizer: PreTrainedTokenizerBase,
    *,
    max_seq_len: int,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> tuple[list[TrainingSequence], SequenceReport]:
    """Supervised fine-tuning's sequences: every assistant message is trained unless its
    ``trainable`` is False, sampled or not (a sample's exact tokens are kept; its logprobs play no
    part in SFT's loss). ``trajectory_index`` is the position in ``trajectories``."""
    return build_sequences(
        [list(trajectories)],
        [[1.0] * len(trajectories)],  # any advantage but 0: none is skipped
        tokenizer,
        max_seq_len=max_seq_len,
        allow_training_without_logprobs=True,
        chat_template_kwargs=chat_template_kwargs,
    )


# --------------------------------------------------------------------------- batches


def pad_batch(sequences: Sequence[TrainingSequence], pad_id: int) -> dict[str, Tensor]:
    """Right-pad into tensors, with the mask and old logprobs shifted for next-token prediction.

    ``assistant_mask[b, t]`` and ``old_logprobs[b, t]`` refer to the token ``input_ids[b, t + 1]``,
    which the logits at position t predict: they line up with ``logits[:, :-1]``.
    """
    if not sequences:
        raise ValueError("pad_batch needs at least one sequence")
    batch, length = len(sequences), max(len(s.input_ids) for s in sequences)  # B, T
    input_ids = torch.full((batch, length), pad_id, dtype=torch.long)  # [B,T]
    attention_mask = torch.zeros((batch, length), dtype=torch.long)  # [B,T]
    trained = torch.zeros((batch, length), dtype=torch.float32)  # [B,T] unshifted
    old_logprobs = torch.full((batch, length), NAN, dtype=torch.float32)  # [B,T] unshifted
    for row, seq in enumerate(sequences):
        n = len(seq.input_ids)
        input_ids[row, :n] = torch.tensor(seq.input_ids, dtype=torch.long)  # [n]
        attention_mask[row, :n] = 1  # [n]
        trained[row, :n] = torch.tensor(seq.assistant_mask, dtype=torch.float32)  # [n]
        old_logprobs[row, :n] = torch.tensor(seq.old_logprobs, dtype=torch.float32)  # [n]
    return {
        "input_ids": input_ids,  # [B,T]
        "attention_mask": attention_mask,  # [B,T]
        "assistant_mask": trained[:, 1:].contiguous(),  # [B,T-1]
        "old_logprobs": old_logprobs[:, 1:].contiguous(),  # [B,T-1]
        "advantages": torch.tensor([s.advantage for s in sequences], dtype=torch.float32),  # [B]
        "group_index": torch.tensor([s.group_index for s in sequences], dtype=torch.long),  # [B]
        "trajectory_index": torch.tensor([s.trajectory_index for s in sequences], dtype=torch.long),  # [B]
    }
