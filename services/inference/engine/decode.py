"""The decode loop of one batch: prefill with left padding, then one forward pass per token.

Rows finish on their own (an end-of-sequence token, a stop string, their token budget, or their
request going away); a finished row leaves the KV cache at once, so the batch shrinks as it runs.
Between steps the batch takes in the rows that ``DecodeContext.admit`` hands over (continuous
batching): they are prefilled on their own and their cache is merged into the running one. Rows
with the same prompt (``n`` completions, or a group of requests for one prompt) share one
prefill. Runs synchronously on the engine's model thread.

Every row is left-padded, so the rows of a batch line up at their right ends: each row's newest
token is the last column. Each row has its own position ids, so how much padding a row carries
never shifts its rotary positions; padded columns are masked out and hold zero keys and values.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import CacheLayerMixin, DynamicLayer

from artery.services.inference.engine.base import EngineError, FinishReason, SamplingParams, TokenStep
from artery.services.inference.engine.sampling import processed_logprobs, sample_tokens, top_alternatives
from artery.services.inference.engine.stops import tail_tokens
from artery.shared.kv_cache_name import CACHE


@dataclass
class DecodeStats:
    """Counters since start; updated before the tokens they produced are emitted.

    ``batches`` counts batches started from an empty cache; rows that join a running batch add a
    forward pass (their prefill), not a batch.
    """

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


def _admit_nothing(running: int) -> list[Row]:
    return []


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
    #: Called between steps with the number of rows decoding: the rows that join the batch now.
    admit: Callable[[int], list[Row]] = _admit_nothing


@dataclass(eq=False)
class _Batch:
    """Rows decoding together and their state, aligned row for row."""

    rows: list[Row]
    cache: DynamicCache
    mask: torch.Tensor  # [B, L]: 1 where a row has a token, 0 on its left padding
    last_pos: torch.Tensor  # [B]: position id of each row's newest token
    logits: torch.Tensor  # [B, V]: each row's logits for its next token


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


def _prefill(rows: list[Row], ctx: DecodeContext) -> _Batch:
    """Run each distinct prompt once, into a cache of its own."""
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
    cache = DynamicCache(config=ctx.model.config)
    out = ctx.model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=positions,
        use_cache=True,
        logits_to_keep=1,
        **{CACHE: cache},
    )
    ctx.stats.forward_passes += 1
    pick = torch.tensor(source, device=ctx.device)  # [B]: which prompt each row continues
    cache.reorder_cache(pick)  # type: ignore[arg-type]  # annotated LongTensor, which no tensor is statically
    return _Batch(list(rows), cache, mask[pick], positions[pick, -1], out.logits[pick, -1, :])


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


def _step(batch: _Batch, ctx: DecodeContext) -> tuple[torch.Tensor, list[int]]:
    """Sample one token for every row and emit it: the tokens, and which rows go on."""
    tokens, chosen, tops = _sample(batch.rows, batch.logits, ctx.device)
    steps: list[tuple[Row, TokenStep]] = []
    going_on: list[int] = []
    for i, (row, token, logprob) in enumerate(zip(batch.rows, tokens.tolist(), chosen, strict=True)):
        if row.cancelled():
            continue
        row.tokens.append(token)
        reason = _finish_reason(row, token, ctx)
        top = tops[i][: row.params.top_logprobs] if row.params.logprobs else []
        steps.append((row, TokenStep(row.index, token, logprob, top, reason)))
        if reason is None:
            going_on.append(i)
    ctx.stats.tokens += len(steps)
    ctx.emit(steps)
    return tokens, going_on


def _retain(batch: _Batch, keep: list[int], tokens: torch.Tensor) -> torch.Tensor:
    """Drop every row but ``keep`` from the batch; the kept rows' tokens."""
    if len(keep) == len(batch.rows):
        return tokens
    index = torch.tensor(keep, device=tokens.device)
    batch.cache.reorder_cache(index)  # type: ignore[arg-type]  # annotated LongTensor: see _prefill
    batch.rows = [batch.rows[i] for i in keep]
    batch.mask, batch.last_pos = batch.mask[index], batch.last_pos[index]
    _trim(batch)
    return tokens[index]


def _trim(batch: _Batch) -> None:
    """Cut the leading columns that every remaining row masks out.

    They belonged to longer rows that have finished; kept, they would cost attention on every
    later step, and a batch that rows keep joining would grow them without end.
    """
    first = int(batch.mask.any(dim=0).int().argmax())  # the first column some row attends to
    if first == 0:
        return
    batch.mask = batch.mask[:, first:]
    for layer in batch.cache.layers:
        # Every layer of a cache decoded here holds keys and values (a DynamicCache, filled).
        assert isinstance(layer, CacheLayerMixin) and layer.keys is not None and layer.values is not None
        layer.keys, layer.values = layer.keys[..., first:, :], layer.values[..., first:, :]


def _advance(batch: _Batch, tokens: torch.Tensor, ctx: DecodeContext) -> None:
    """Feed each row its newest token: one forward pass, the logits for the next one."""
    batch.mask = torch.cat([batch.mask, batch.mask.new_ones((len(batch.rows), 1))], dim=-1)  # [B, L + 1]
    batch.last_pos = batch.last_pos + 1  # [B]
    out = ctx.model(
        input_ids=tokens[:, None],
        attention_mask=batch.mask,
        position_ids=batch.last_pos[:, None],
        use_cache=True,
        **{CACHE: batch.cache},
    )
    ctx.stats.forward_passes += 1
    batch.logits = out.logits[:, -1, :]  # [B, V]


def _joinable(cache: DynamicCache) -> bool:
    """Whether caches like this one can be merged: plain growing layers only (no sliding window,
    whose layers count the tokens they have seen, and no layers that share another's cache)."""
    return all(type(layer) is DynamicLayer and layer.is_initialized for layer in cache.layers)


def _pad_left(tensor: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """``tensor`` with zeros prepended along ``dim`` (counted from the end) up to ``width``."""
    missing = width - tensor.shape[dim]
    if missing == 0:
        return tensor
    return F.pad(tensor, (0, 0) * (-dim - 1) + (missing, 0))


def _join(batch: _Batch, joining: _Batch) -> None:
    """Append ``joining``'s rows to ``batch``.

    Both are left-padded, so their columns line up at the right once the one with fewer columns
    is padded on the left with more: zero keys and values (``[B, heads, L, head_dim]``) that its
    mask (``[B, L]``) hides. Then everything is concatenated along the batch dimension.
    """
    width = max(batch.mask.shape[-1], joining.mask.shape[-1])
    for mine, theirs in zip(batch.cache.layers, joining.cache.layers, strict=True):
        assert isinstance(mine, DynamicLayer) and isinstance(theirs, DynamicLayer)  # ``_joinable``
        assert mine.keys is not None and mine.values is not None
        assert theirs.keys is not None and theirs.values is not None
        mine.keys = torch.cat([_pad_left(mine.keys, width, -2), _pad_left(theirs.keys, width, -2)])
        mine.values = torch.cat([_pad_left(mine.values, width, -2), _pad_left(theirs.values, width, -2)])
    batch.mask = torch.cat([_pad_left(batch.mask, width, -1), _pad_left(joining.mask, width, -1)])
    batch.rows = batch.rows + joining.rows
    batch.last_pos = torch.cat([batch.last_pos, joining.last_pos])
    batch.logits = torch.cat([batch.logits, joining.logits])


def decode_batch(rows: list[Row], ctx: DecodeContext) -> None:
    """Decode every row, and every row admitted on the way, to its end."""
    ctx.stats.batches += 1
    batch = _prefill(rows, ctx)
    joinable = _joinable(batch.cache)
    while True:
        if ctx.abort.is_set():
            raise Aborted("the engine is closing")
        tokens, keep = _step(batch, ctx)
        if not keep:
            return
        _advance(batch, _retain(batch, keep, tokens), ctx)
        newcomers = ctx.admit(len(batch.rows)) if joinable else []
        if newcomers:
            _join(batch, _prefill(newcomers, ctx))
