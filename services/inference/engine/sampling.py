"""Sampling and log-probabilities for one decode step of a batch: pure tensor functions.

Every row carries its own settings (temperature, top_p) and its own random stream, so a row
samples the same tokens whichever rows share its batch.

Log-probabilities are those of the distribution that is sampled from, after temperature and
*before* top-p truncation: ``log_softmax(logits / temperature)`` over the whole vocabulary. That
is what a trainer recomputes (it has the logits and the temperature, it does not re-apply top-p),
so importance ratios start at exactly 1. Greedy rows (temperature 0) are scored at temperature 1.
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1


def completion_seed(seed: int, index: int) -> int:
    """A seed for completion ``index`` of a request seeded with ``seed`` (splitmix64 of both)."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1  # torch seeds must fit in a signed 64-bit integer


def processed_logprobs(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """``[B, V]`` logits, ``[B]`` temperatures -> ``[B, V]`` float32 log-probabilities."""
    scale = torch.where(temperature > 0, temperature, torch.ones_like(temperature))  # [B]
    return torch.log_softmax(logits.float() / scale[:, None].float(), dim=-1)  # [B, V]


#: Top-p looks for its nucleus among this many most likely tokens first: a full sort of a
#: 150k vocabulary costs ~200 ms a step on two CPU cores, a top-k of 512 ~10 ms.
NUCLEUS_CANDIDATES = 512


def sample_tokens(
    logprobs: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, uniform: torch.Tensor
) -> torch.Tensor:
    """Inverse-CDF sampling, one draw per row.

    ``logprobs`` ``[B, V]`` from :func:`processed_logprobs`; ``temperature``, ``top_p`` and
    ``uniform`` (a draw in [0, 1) from each row's own generator) are ``[B]``. Rows with temperature
    0 take the argmax. Top-p keeps the smallest set of most likely tokens whose mass reaches
    ``top_p`` (always at least one) and renormalises over it. Which way a row is sampled depends
    on that row alone, so its batch mates never change its tokens.
    """
    tokens = logprobs.argmax(dim=-1)  # [B]: greedy, overwritten below for sampling rows
    sampling = temperature > 0  # [B]
    whole = (sampling & (top_p >= 1)).nonzero().squeeze(-1)  # [W]: rows sampling the whole vocabulary
    if whole.numel():
        tokens[whole] = _inverse_cdf(logprobs[whole].exp(), uniform[whole])
    nucleus = (sampling & (top_p < 1)).nonzero().squeeze(-1)  # [N]: rows sampling a nucleus
    if nucleus.numel():
        tokens[nucleus] = _sample_nucleus(logprobs[nucleus].exp(), top_p[nucleus], uniform[nucleus])
    return tokens


def _sample_nucleus(probs: torch.Tensor, top_p: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """``[N, V]`` probabilities -> ``[N]`` tokens drawn from each row's top-p nucleus."""
    if probs.shape[-1] <= 4 * NUCLEUS_CANDIDATES:  # a small vocabulary: sorting it all is cheap
        values, order = probs.sort(dim=-1, descending=True)  # [N, V], [N, V]
        return _draw_from_sorted(values, order, top_p, uniform)
    values, order = probs.topk(NUCLEUS_CANDIDATES, dim=-1)  # [N, k], [N, k]: most likely first
    covered = values.cumsum(dim=-1)[:, -1] >= top_p  # [N]: the nucleus lies within these k
    tokens = torch.empty_like(top_p, dtype=torch.long)  # [N]
    rows = covered.nonzero().squeeze(-1)
    if rows.numel():
        tokens[rows] = _draw_from_sorted(values[rows], order[rows], top_p[rows], uniform[rows])
    rows = (~covered).nonzero().squeeze(-1)
    if rows.numel():  # a flat distribution: sort the whole vocabulary
        values, order = probs[rows].sort(dim=-1, descending=True)  # [R, V], [R, V]
        tokens[rows] = _draw_from_sorted(values, order, top_p[rows], uniform[rows])
    return tokens


def _draw_from_sorted(
    probs: torch.Tensor, order: torch.Tensor, top_p: torch.Tensor, uniform: torch.Tensor
) -> torch.Tensor:
    """``[R, K]`` probabilities sorted descending and their token ids -> ``[R]`` nucleus draws."""
    mass_before = probs.cumsum(dim=-1) - probs  # [R, K]: mass of the more likely tokens
    kept = probs * (mass_before < top_p[:, None])  # [R, K]: the nucleus, unnormalised
    return order.gather(-1, _inverse_cdf(kept, uniform)[:, None]).squeeze(-1)  # [R]


def _inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """``[R, V]`` unnormalised probabilities, ``[R]`` draws -> ``[R]`` column indices."""
    cdf = probs.cumsum(dim=-1)  # [R, V]
    target = uniform.to(cdf) * cdf[:, -1]  # [R]: a point in the row's mass
    # The first column whose cdf passes the point: it always has mass of its own.
    pick = torch.searchsorted(cdf, target[:, None], right=True).squeeze(-1)  # [R]
    width = probs.shape[-1]
    beyond = (pick >= width).nonzero().squeeze(-1)  # [O]: rounding put the point at the very end
    if beyond.numel():  # take the last column that has mass
        pick[beyond] = width - 1 - (probs[beyond] > 0).flip(-1).int().argmax(dim=-1)
    return pick  # [R]


def top_alternatives(logprobs: torch.Tensor, k: int) -> list[list[tuple[int, float]]]:
    """The ``k`` most likely tokens of each row as ``(token_id, logprob)``, most likely first."""
    if k <= 0:
        return [[] for _ in range(logprobs.shape[0])]
    values, ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)  # [B, k], [B, k]
    return [
        list(zip(row_ids, row_values, strict=True))
        for row_ids, row_values in zip(ids.tolist(), values.tolist(), strict=True)
    ]
