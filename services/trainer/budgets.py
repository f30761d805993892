"""What one train request may cost, checked before a tensor is made.

Agents are strangers on a shared trainer: a 40 KB trajectory of a few hundred one-token turns
renders a prompt per turn, and each turn that does not continue the tokens before it becomes a
sequence of its own, up to ``max_seq_len`` long; their micro-batches once grew a trainer past what
the machine had. So a request is measured twice, and refused at the first budget it exceeds:

- before loading the groups, the size of their stored trajectories;
- before tokenizing, from the stored trajectories alone: sampled turns per trajectory, the
  conversations of each group and of the request (each gives at least one sequence when trained),
  and how much text the chat template will render for them (each turn's prompt again);
- after tokenizing (lists of ints, still no tensor): the sequences of each group and of the
  request, each sequence's length before it is cut to ``max_seq_len``, the tokens of the whole
  request, and an estimate of the memory of the largest micro-batch.

A refusal is final (``BudgetExceeded``, a ``ValueError``): the same request exceeds the same budget
on every trainer with the same settings, so it is answered with ``train.failed``, not retried.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from artery.schemas import Trajectory
from artery.services.trainer.settings import TrainerSettings

MIB = 1 << 20


class BudgetExceeded(ValueError):
    """A request costs more than ``budget`` allows: ``figure`` against ``limit``."""

    def __init__(self, budget: str, figure: int, limit: int, what: str) -> None:
        super().__init__(
            f"budget {budget} exceeded: {what} {figure:,} > {limit:,}"
            f" (ARTERY_TRAINER_{budget.upper()}); the request is refused, not retried"
        )
        self.budget = budget
        self.figure = figure
        self.limit = limit


def sampled_turns(trajectory: Trajectory) -> int:
    """Assistant messages carrying an engine sample, in the trajectory and its additional histories."""
    conversations = [trajectory.messages, *(h.messages for h in trajectory.additional_histories)]
    return sum(1 for messages in conversations for m in messages if m.sample is not None)


def conversations(trajectory: Trajectory) -> int:
    return 1 + len(trajectory.additional_histories)


def rendered_bytes(trajectory: Trajectory) -> int:
    """What the chat template renders to tokenize the trajectory, at most: each assistant turn's
    prompt is the conversation before it (and its tools), so a long conversation of many turns
    renders its beginning again and again (JSON sizes, a bound on the text)."""
    total = 0
    histories = [(trajectory.messages, trajectory.tools)]
    histories += [(h.messages, h.tools) for h in trajectory.additional_histories]
    for messages, tools in histories:
        tools_size = len(msgspec.json.encode(tools)) if tools else 0
        before = 0
        for message in messages:
            before += len(msgspec.json.encode(message))
            if message.role == "assistant":
                total += before + tools_size
    return total


def check_trajectories(settings: TrainerSettings, groups: Sequence[Sequence[Trajectory]]) -> None:
    """The budgets that need no tokenizer, in the order of their cost to exceed."""
    total = rendered = 0
    for g, group in enumerate(groups):
        for t, trajectory in enumerate(group):
            rendered += rendered_bytes(trajectory)
            turns = sampled_turns(trajectory)
            if turns > settings.max_sampled_turns:
                raise BudgetExceeded(
                    "max_sampled_turns",
                    turns,
                    settings.max_sampled_turns,
                    f"group {g} trajectory {t}: sampled turns",
                )
        in_group = sum(conversations(t) for t in group)
        if in_group > settings.max_group_sequences:
            raise BudgetExceeded(
                "max_group_sequences", in_group, settings.max_group_sequences, f"group {g}: conversations"
            )
        total += in_group
    if total > settings.max_request_sequences:
        raise BudgetExceeded(
            "max_request_sequences", total, settings.max_request_sequences, "conversations of the request"
        )
    if rendered > settings.max_rendered_mib * MIB:
        raise BudgetExceeded(
            "max_rendered_mib",
            -(-rendered // MIB),
            settings.max_rendered_mib,
            "MiB the chat template renders",
        )


def check_stored_bytes(settings: TrainerSettings, size: int) -> None:
    """Before decoding: the groups' stored JSON (decoded objects take several times as much)."""
    limit = settings.max_request_mib * MIB
    if size > limit:
        raise BudgetExceeded(
            "max_request_mib", -(-size // MIB), settings.max_request_mib, "MiB of trajectories"
        )


def check_group_count(settings: TrainerSettings, named: int) -> None:
    """Before loading anything: every group named gives at least one conversation."""
    if named > settings.max_request_sequences:
        raise BudgetExceeded(
            "max_request_sequences", named, settings.max_request_sequences, "groups named by the request"
        )


@dataclass(frozen=True)
class ModelShape:
    """What a micro-batch's memory depends on, read from the model's configuration."""

    layers: int
    hidden: int
    intermediate: int
    vocab: int
    bytes_per_value: int

    @classmethod
    def of(cls, model: Any) -> ModelShape:
        config = model.config
        config = getattr(config, "text_config", None) or config
        hidden = int(config.hidden_size)
        dtype = next(model.parameters()).dtype
        return cls(
            layers=int(config.num_hidden_layers),
            hidden=hidden,
            intermediate=int(getattr(config, "intermediate_size", None) or 4 * hidden),
            vocab=int(config.vocab_size),
            bytes_per_value=max(dtype.itemsize, 2),
        )

    def micro_batch_bytes(self, rows: int, length: int, logit_positions: int | None = None) -> int:
        """An estimate of what one forward/backward over ``rows`` x ``length`` tokens keeps: per
        token and layer, the decoder's saved activations (about 10 hidden-sized and 4
        intermediate-sized values for a pre-norm attention + gated MLP layer, memory-efficient
        attention: no length-squared scores); per logit position (from the first trained one on,
        ``logprobs.next_token_logprobs``; all by default), the logits and their gradient. Meant to
        err high: SmolLM2-135M in float32 comes to 1.4 MB a token, 3 GB for a micro-batch of
        8 x 250 tokens training their last 20 (``memory.py``: 2.4 GB stayed resident after such a
        step)."""
        body = self.layers * (10 * self.hidden + 4 * self.intermediate)
        kept = length if logit_positions is None else logit_positions
        return rows * (length * body + kept * 2 * self.vocab) * self.bytes_per_value


def memory_limit_bytes(settings: TrainerSettings, device: str) -> int:
    """The step-memory budget: the setting, or half the machine's memory (the GPU's on cuda)."""
    if settings.max_step_memory_mib:
        return settings.max_step_memory_mib * MIB
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_properties(torch.device(device)).total_memory // 2
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


@dataclass(frozen=True)
class StepBudget:
    """The post-tokenization budgets, handed to ``Policy`` (which knows its model and micro-batches)."""

    settings: TrainerSettings
    memory_limit: int

    def check_sequences(
        self, sequences: Sequence[Any], uncut_longest: int, shape: ModelShape, micro_batch_size: int
    ) -> None:
        """Sequences per group and per request, the longest sequence before it was cut
        (``uncut_longest``), tokens per request, and the memory estimate of the largest
        micro-batch (in the order the step will run them)."""
        s = self.settings
        longest = max([uncut_longest, *(len(seq.input_ids) for seq in sequences)])
        if longest > s.max_sequence_tokens:
            raise BudgetExceeded(
                "max_sequence_tokens", longest, s.max_sequence_tokens, "tokens of a sequence"
            )
        per_group = Counter(seq.group_index for seq in sequences)
        if per_group:
            group, count = per_group.most_common(1)[0]
            if count > s.max_group_sequences:
                raise BudgetExceeded(
                    "max_group_sequences", count, s.max_group_sequences, f"group {group}: sequences"
                )
        if len(sequences) > s.max_request_sequences:
            raise BudgetExceeded(
                "max_request_sequences", len(sequences), s.max_request_sequences, "sequences of the request"
            )
        tokens = sum(len(seq.input_ids) for seq in sequences)
        if tokens > s.max_request_tokens:
            raise BudgetExceeded("max_request_tokens", tokens, s.max_request_tokens, "tokens of the request")
        largest = 0
        for start in range(0, len(sequences), micro_batch_size):
            micro = sequences[start : start + micro_batch_size]
            length = max(len(q.input_ids) for q in micro)
            first_trained = min(_first_trained(q.assistant_mask) for q in micro)
            largest = max(largest, shape.micro_batch_bytes(len(micro), length, length - first_trained))
        if largest > self.memory_limit:
            raise BudgetExceeded(
                "max_step_memory_mib",
                -(-largest // MIB),
                self.memory_limit // MIB,
                "estimated MiB of the largest micro-batch",
            )


def _first_trained(mask: Sequence[int]) -> int:
    """The position of the first trained token (its logits start one before: harmless to ignore)."""
    return next((i for i, bit in enumerate(mask) if bit), 0)
