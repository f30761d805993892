"""Log-probabilities of the trained tokens, without the full-vocabulary copies autograd would keep,
and without passing a prompt the rows share once per row.

The largest tensors of a step are the logits ([B,T,V]: 49,152 columns for SmolLM2); these functions
make logits only from the first trained position on and take their log-softmax a few positions
at a time, in forward and in backward.

The rollouts of a group answer the same prompt, and a micro-batch holds a group (or a few): its
rows begin with the same tokens, often most of each row (the demo's prompt is 77 tokens, its
answers at most 20). Those positions go through the model once, and the rows continue from that
one KV cache; the gradient through the cache sums what every row sends back to the prompt, so the
logprobs and gradients are those of the rows passed whole. (With LoRA dropout, the shared
positions draw one dropout mask for all the rows instead of one each.)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from artery.shared.kv_cache_name import CACHE

#: Logits per chunk of ``TokenLogprobs`` (16 MiB of float32): small next to the logits themselves.
LOGPROB_CHUNK_ELEMENTS = 1 << 22


def logprob_chunks(logits: Tensor) -> Iterator[slice]:
    """Slices over the positions of ``logits`` [B,T,V], each about ``LOGPROB_CHUNK_ELEMENTS``."""
    batch, length, vocab = logits.shape
    size = max(1, LOGPROB_CHUNK_ELEMENTS // max(1, batch * vocab))
    for start in range(0, length, size):
        yield slice(start, start + size)


class TokenLogprobs(torch.autograd.Function):
    """``log_softmax(logits.float() / temperature)`` at ``targets``, a few positions at a time.

    Autograd's version of the same formula (``scaled.gather(...) - logsumexp(scaled)``) keeps a
    float32 copy of the scaled logits for backward, and its backward makes three or four more
    full-vocabulary tensors ([B,T,V]: 49152 columns for SmolLM2). This keeps only the logits it was
    given and a [B,T] logsumexp; backward recomputes the softmax chunk by chunk into one gradient.
    """

    @staticmethod
    def forward(ctx: Any, logits: Tensor, targets: Tensor, temperature: float) -> Tensor:
        logsumexp = logits.new_empty(targets.shape, dtype=torch.float32)  # [B,T]
        picked = logits.new_empty(targets.shape, dtype=torch.float32)  # [B,T]
        for positions in logprob_chunks(logits):
            scaled = logits[:, positions].float() / temperature  # [B,c,V]
            logsumexp[:, positions] = torch.logsumexp(scaled, dim=-1)  # [B,c]
            picked[:, positions] = scaled.gather(-1, targets[:, positions, None]).squeeze(-1)  # [B,c]
        ctx.save_for_backward(logits, targets, logsumexp)
        ctx.temperature = temperature
        return picked - logsumexp  # [B,T]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        logits, targets, logsumexp = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)  # [B,T,V]
        for positions in logprob_chunks(logits):
            scaled = logits[:, positions].float() / ctx.temperature  # [B,c,V]
            softmax = torch.exp(scaled - logsumexp[:, positions, None])  # [B,c,V]
            upstream = grad[:, positions, None]  # [B,c,1]
            # d(picked - logsumexp)/d(scaled) = one_hot(target) - softmax
            chunk = (softmax * upstream).neg_().scatter_add_(-1, targets[:, positions, None], upstream)
            grad_logits[:, positions] = chunk / ctx.temperature  # [B,c,V]
        return grad_logits, None, None


def token_logprobs(logits: Tensor, targets: Tensor, temperature: float) -> Tensor:
    """log p(targets[:, t]) from logits[:, t] at ``temperature``: [B,T,V], [B,T] -> [B,T] float32."""
    return TokenLogprobs.apply(logits, targets, temperature)


def first_trained_position(assistant_mask: Tensor) -> int:
    """The first position [B,T] that any row trains; 0 when none does."""
    trained = assistant_mask.any(dim=0).nonzero()  # [n,1]
    return int(trained[0, 0]) if len(trained) else 0


#: A shared prefix shorter than this is passed with each row: its own pass would cost more than it saves.
MIN_SHARED_PREFIX = 8


def shared_prefix_length(batch: dict[str, Tensor]) -> int:
    """How many leading positions every row of a batch of two or more has in common (the same
    tokens, none of them padding), up to the first trained position; 0 for a single row."""
    input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]  # [B,T] x2
    if input_ids.size(0) < 2:
        return 0
    same = (input_ids == input_ids[:1]).all(dim=0) & attention_mask.bool().all(dim=0)  # [T]
    differs = (~same).nonzero()  # [n,1]
    common = int(differs[0, 0]) if len(differs) else input_ids.size(1)
    # Logits are kept from the first trained position on: those positions must be in the rows' pass.
    return min(common, first_trained_position(batch["assistant_mask"]))


def logits_after_shared_prefix(model: Any, batch: dict[str, Tensor], prefix: int, kept: int) -> Tensor | None:
    """The logits of the last ``kept`` positions [B,kept,V], the first ``prefix`` positions (the
    same in every row) passed once and their KV cache repeated for the rows. None when the model
    returns no cache that can be repeated (then the caller passes the rows whole)."""
    input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]  # [B,T] x2
    cache = model(
        input_ids=input_ids[:1, :prefix],  # [1,prefix]
        attention_mask=attention_mask[:1, :prefix],  # [1,prefix]
        use_cache=True,
        logits_to_keep=1,  # none are used; 0 would mean all of them
    ).get(CACHE)
    if cache is None or not hasattr(cache, "batch_repeat_interleave"):
        return None
    cache.batch_repeat_interleave(input_ids.size(0))  # [1,...] -> [B,...]; backward sums the rows
    return model(
        input_ids=input_ids[:, prefix:],  # [B,T-prefix]
        attention_mask=attention_mask,  # [B,T]: the cached positions and the rows'
        use_cache=True,
        logits_to_keep=kept,  # kept <= T - prefix: the prefix ends at or before the first trained position
        **{CACHE: cache},
    ).logits


def next_token_logprobs(model: Any, batch: dict[str, Tensor], temperature: float) -> Tensor:
    """log p(input_ids[:, t+1]) from the model's logits at t, for a padded batch: [B,T-1].

    Logits are made only from the first trained position on (``logits_to_keep``): a prompt's
    positions are never trained, and logits ([B,T,V], over the whole vocabulary) are the largest
    tensors of a step. The positions before it get 0, which every loss masks out (``assistant_mask``
    is 0 there). The positions every row shares (a group's prompt) go through the model once.
    """
    input_ids = batch["input_ids"]  # [B,T]
    start = first_trained_position(batch["assistant_mask"])
    kept = input_ids.size(1) - start  # positions start .. T-1
    logits = None
    prefix = shared_prefix_length(batch)
    if prefix >= MIN_SHARED_PREFIX and not getattr(model, "is_gradient_checkpointing", False):
        logits = logits_after_shared_prefix(model, batch, prefix, kept)  # [B,kept,V] or None
    if logits is None:
        logits = model(
            input_ids=input_ids, attention_mask=batch["attention_mask"], logits_to_keep=kept
        ).logits  # [B,kept,V]
    if logits.size(1) != kept:  # a model that ignores logits_to_keep returns every position
        logits = logits[:, -kept:]  # [B,kept,V]
    # The last position predicts past the end: it gets a placeholder target and its logprob is
    # dropped, so that the logits are used whole (a slice of them costs a full copy in backward).
    targets = torch.nn.functional.pad(input_ids[:, start + 1 :], (0, 1))  # [B,kept]
    logprobs = token_logprobs(logits, targets, temperature)[:, :-1]  # [B,T-1-start]
    return torch.nn.functional.pad(logprobs, (start, 0))  # [B,T-1]
