"""Stored trajectories become training sequences: token ids, a mask of trained tokens, old logprobs.

Rules, as ART's tokenizer:

- Each conversation (the trajectory's messages, and each of its ``additional_histories``) becomes its
  own sequence with the trajectory's advantage; a trajectory whose advantage is exactly zero gives
  none (its group had equal rewards, or it scored exactly the mean).
- An assistant message is trained when ``trainable`` is True, or when it is unset and the message has
  a ``sample`` (engine output); without a sample only with ``allow_training_without_logprobs``. The
  conversation is cut after the last trained message; one with no trained message gives no sequence.
- A sampled message is trained on exactly the tokens the engine saw and produced: its prompt rendered
  by the same call the inference service makes (``shared.chat_template``), then its sampled ids and
  logprobs. A trained message without a sample keeps the template's tokens inside its
  ``{% generation %}`` block, with NaN old logprobs. Everything else has mask 0.
- Where a later turn's prompt does not continue the tokens of the turns before it (the template
  re-renders an earlier sample differently), the conversation gives one sequence per such part:
  see ``conversation.py``, which turns one conversation into tokens.
- A sequence longer than ``max_seq_len`` is cut from the right when a trained token survives, else
  dropped. Every cut, split and drop is reported with its reason.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict

import torch
from torch import Tensor

from artery.schemas import Trajectory
from artery.services.trainer.conversation import (
    NAN,
    DropReason,
    Prompts,
    SequenceError,
    fit_length,
    tokenize_conversation,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


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
    #: 0, or i for the conversation's (i+1)th part where it was split (``conversation.py``).
    part_index: int = 0


@dataclass(frozen=True, kw_only=True)
class Dropped:
    group_index: int
    trajectory_index: int
    #: None when the whole trajectory was skipped (zero advantage).
    history_index: int | None
    #: The part of a split conversation; None when the conversation as a whole was dropped.
    part_index: int | None = None
    reason: DropReason
    detail: str = ""


class _Trajectory(TypedDict):
    """Which trajectory a sequence, cut or drop comes from."""

    group_index: int
    trajectory_index: int


class _Part(_Trajectory):
    """Which part of which of its conversations."""

    history_index: int
    part_index: int


@dataclass(frozen=True, kw_only=True)
class Cut:
    group_index: int
    trajectory_index: int
    history_index: int
    part_index: int = 0
    length: int
    kept: int


@dataclass(frozen=True, kw_only=True)
class SequenceReport:
    trajectories: int
    #: Trajectories that gave at least one sequence.
    used: int
    sequences: int
    #: Parts beyond the first of split conversations: the sequences a split added.
    split: int = 0
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
            "sequences_split": self.split,
            **{f"dropped/{reason}": n for reason, n in sorted(reasons.items())},
        }


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
    prompts: Prompts | None = None,
) -> tuple[list[TrainingSequence], list[Cut], list[Dropped], int]:
    """The sequences of one trajectory (its messages, then each additional history), its cuts,
    its drops, and how many sequences splitting conversations added. ``prompts``: the step's
    rendered prompts (``conversation.Prompts``)."""
    where = _Trajectory(group_index=group_index, trajectory_index=trajectory_index)
    if advantage == 0.0:
        return [], [], [Dropped(**where, history_index=None, reason="zero_advantage")], 0
    conversations = [(trajectory.messages, trajectory.tools)]
    conversations += [(h.messages, h.tools) for h in trajectory.additional_histories]
    sequences: list[TrainingSequence] = []
    cuts: list[Cut] = []
    dropped: list[Dropped] = []
    split = 0
    for history_index, (messages, tools) in enumerate(conversations):
        try:
            parts = tokenize_conversation(
                messages,
                tools,
                tokenizer,
                allow_training_without_logprobs=allow_training_without_logprobs,
                chat_template_kwargs=chat_template_kwargs,
                prompts=prompts,
            )
        except SequenceError as exc:
            dropped.append(
                Dropped(**where, history_index=history_index, reason=exc.reason, detail=exc.detail)
            )
            continue
        split += len(parts) - 1
        for part_index, full in enumerate(parts):
            at = _Part(**where, history_index=history_index, part_index=part_index)
            try:
                tokens = fit_length(full, max_seq_len)
            except SequenceError as exc:
                dropped.append(Dropped(**at, reason=exc.reason, detail=exc.detail))
                continue
            if len(tokens.input_ids) < len(full.input_ids):
                cuts.append(Cut(**at, length=len(full.input_ids), kept=len(tokens.input_ids)))
            sequences.append(
                TrainingSequence(
                    input_ids=tokens.input_ids,
                    assistant_mask=tokens.assistant_mask,
                    old_logprobs=tokens.logprobs,
                    advantage=float(advantage),
                    **at,
                )
            )
    return sequences, cuts, dropped, split


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
    seen = used = split = 0
    prompts = Prompts()  # a group's rollouts share their prompt: rendered once
    for group_index, (group, group_adv) in enumerate(zip(groups, advantages, strict=True)):
        for trajectory_index, (trajectory, advantage) in enumerate(zip(group, group_adv, strict=True)):
            made, cut, drop, more = trajectory_sequences(
                trajectory,
                float(advantage),
                tokenizer,
                max_seq_len=max_seq_len,
                group_index=group_index,
                trajectory_index=trajectory_index,
                allow_training_without_logprobs=allow_training_without_logprobs,
                chat_template_kwargs=chat_template_kwargs,
                prompts=prompts,
            )
            seen += 1
            used += bool(made)
            sequences += made
            cuts += cut
            dropped += drop
            split += more
    report = SequenceReport(
        trajectories=seen,
        used=used,
        sequences=len(sequences),
        split=split,
        cut=tuple(cuts),
        dropped=tuple(dropped),
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
