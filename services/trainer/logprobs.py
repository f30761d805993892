"""Log-probabilities of the trained tokens, without the full-vocabulary copies autograd would keep.

The largest tensors of a step are the logits ([B,T,V]: 49,152 columns for SmolLM2); these functions
make logits only from the first trained position on and take their log-softmax a few positions
at a time, in forward and in backward.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

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


def next_token_logprobs(model: Any, batch: dict[str, Tensor], temperature: float) -> Tensor:
    """log p(input_ids[:, t+1]) from the model's logits at t, for a padded batch: [B,T-1].

    Logits are made only from the first trained position on (``logits_to_keep``): a prompt's
    positions are never trained, and logits ([B,T,V], over the whole vocabulary) are the largest
    tensors of a step. The positions before it get 0, which every loss masks out (``assistant_mask``
    is 0 there).
    """
    input_ids = batch["input_ids"]  # [B,T]
    start = first_trained_position(batch["assistant_mask"])
    kept = input_ids.size(1) - start  # positions start .. T-1
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
