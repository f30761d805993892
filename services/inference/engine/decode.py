"""The decode loop of one batch: prefill with left padding, then one forward pass per token.

Rows finish on their own (an end-of-sequence token, a stop string, their token budget, or their
request going away); a finished row leaves the KV cache at once, so the batch shrinks as it runs.
Rows with the same prompt (``n`` completions, or a group of requests for one prompt) share one
prefill. Runs synchronously on the engine's model thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from artery.services.inference.engine.base import EngineError, FinishReason, SamplingParams, TokenStep
from artery.services.inference.engine.sampling import processed_logprobs, sample_tokens, top_alternatives
from artery.services.inference.engine.stops import tail_tokens


@dataclass
class DecodeStats:
    """Counters since start; updated before the tokens they produced are emitted."""

    forward_passes: int = 0
    batches: int = 0
    tokens: int = 0


class Aborted(EngineError):
    """The engine is closing; the batch stopped mid-way."""


@dataclass(eq=False)
class Row:
    """One completion being decoded."""

    owner: Any  # the request this row belongs to (opaque here)
    index: int  # which of the owner's n completions
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator
    max_new_tokens: int
    tokens: list[int] = field(default_factory=list)
    cancelled: Callable[[], bool] = lambda: False


@dataclass(frozen=True)
class DecodeContext:
    model: Any
    tokenizer: Any
    device: torch.device
    eos_ids: frozenset[int]
    pad_id: int
    #: Receives each step's sampled tokens, in row order, from the model thread.
    emit: Callable[[list[tuple[Row, TokenStep]]], None]
    abort: threading.Event
    stats: DecodeStats


def _finish_reason(row: Row, token: int, ctx: DecodeContext) -> FinishReason | None:
    if token in ctx.eos_ids:
        return "stop"
    stops = row.params.stop
    if stops:
        tail = ctx.tokenizer.decode(row.tokens[-tail_tokens(stops) :], skip_special_tokens=True)
        if any(s and s in tail for s in stops):
            return "stop"
    if len(row.tokens) >= row.max_new_tokens:
        return "length"
    return None


def _prefill(rows: list[Row], ctx: DecodeContext, cache: DynamicCache):
    """Run each distinct prompt once; return per-row logits, attention mask and last positions."""
    distinct: dict[tuple[int, ...], int] = {}
    source = [distinct.setdefault(tuple(r.prompt), len(distinct)) for r in rows]
    prompts = list(distinct)
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), ctx.pad_id, dtype=torch.long)  # [U, L]
    mask = torch.zeros((len(prompts), width), dtype=torch.long)  # [U, L]
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    ids, mask = ids.to(ctx.device), mask.to(ctx.device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [U, L]
    out = ctx.model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    pick = torch.tensor(source, device=ctx.device)  # [B]: which prompt each row continues
    cache.reorder_cache(pick)
    return out.logits[pick, -1, :], mask[pick], positions[pick, -1]  # [B, V], [B, L], [B]


def _sample(rows: list[Row], logits: torch.Tensor, device: torch.device):
    """Tokens, their logprobs and the asked-for alternatives for every row of this step."""
    temperature = torch.tensor([r.params.temperature for r in rows], device=device)  # [B]
    top_p = torch.tensor([r.params.top_p for r in rows], device=device)  # [B]
    uniform = torch.tensor(  # [B]: one draw per sampling row, from that row's own stream
        [torch.rand((), generator=r.generator).item() if r.params.temperature > 0 else 0.0 for r in rows],
        device=device,
    )
    logprobs = processed_logprobs(logits, temperature)  # [B, V]
    tokens = sample_tokens(logprobs, temperature, top_p, uniform)  # [B]
    chosen = logprobs.gather(-1, tokens[:, None]).squeeze(-1)  # [B]
    k = max((r.params.top_logprobs for r in rows if r.params.logprobs), default=0)
    return tokens, chosen.tolist(), top_alternatives(logprobs, k)


def decode_batch(rows: list[Row], ctx: DecodeContext) -> None:
    """Decode every row to its end."""
    ctx.stats.batches += 1
    cache = DynamicCache(config=ctx.model.config)
    logits, mask, last_pos = _prefill(rows, ctx, cache)
    ctx.stats.forward_passes += 1
    live = list(rows)
    while True:
        if ctx.abort.is_set():
            raise Aborted("the engine is closing")
        tokens, chosen, tops = _sample(live, logits, ctx.device)
        steps: list[tuple[Row, TokenStep]] = []
        keep: list[int] = []
        for i, (row, token, logprob) in enumerate(zip(live, tokens.tolist(), chosen, strict=True)):
            if row.cancelled():
                continue
            row.tokens.append(token)
            reason = _finish_reason(row, token, ctx)
            top = tops[i][: row.params.top_logprobs] if row.params.logprobs else []
            steps.append((row, TokenStep(row.index, token, logprob, top, reason)))
            if reason is None:
                keep.append(i)
        ctx.stats.tokens += len(steps)
        ctx.emit(steps)
        if not keep:
            return
        if len(keep) < len(live):
            index = torch.tensor(keep, device=ctx.device)
            cache.reorder_cache(index)
            live, tokens, mask, last_pos = (
                [live[i] for i in keep],
                tokens[index],
                mask[index],
                last_pos[index],
            )
        mask = torch.cat([mask, mask.new_ones((len(live), 1))], dim=-1)  # [B, L + 1]
        last_pos = last_pos + 1  # [B]
        out = ctx.model(
            input_ids=tokens[:, None],
            attention_mask=mask,
            position_ids=last_pos[:, None],
            past_key_values=cache,
            use_cache=True,
        )
        ctx.stats.forward_passes += 1
        logits = out.logits[:, -1, :]  # [B, V]
