"""GRPO math: group advantages and the loss variants, by hand and against TRL's own implementation."""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from artery.services.trainer.advantages import group_advantages, is_degenerate
from artery.services.trainer.losses import LossConfig, LossInputs, select_loss

# --------------------------------------------------------------------------- advantages


def test_advantages_centered_without_scaling() -> None:
    # mean = (1 + 0 + 0.5 + 0.5) / 4 = 0.5
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5])
    assert group_advantages(rewards, scale=False).tolist() == [0.5, -0.5, 0.0, 0.0]


def test_advantages_scaled_by_population_std() -> None:
    # population std = sqrt((0.25 + 0.25 + 0 + 0) / 4) = sqrt(0.125) = 0.353553...
    # (the sample std, sqrt(0.5 / 3) = 0.408248, would give ±1.2247)
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5], dtype=torch.float64)
    expected = 0.5 / (math.sqrt(0.125) + 1e-6)  # 1.414209...
    got = group_advantages(rewards, scale=True)
    assert got.tolist() == pytest.approx([expected, -expected, 0.0, 0.0], abs=1e-12)
    assert got[0].item() == pytest.approx(1.4142096, abs=1e-6)


def test_advantages_custom_eps() -> None:
    # rewards [0, 2]: mean 1, population std 1, so ±1 / (1 + 1) = ±0.5 with eps = 1
    assert group_advantages(torch.tensor([0.0, 2.0]), scale=True, eps=1.0).tolist() == [-0.5, 0.5]


@pytest.mark.parametrize("scale", [False, True])
def test_equal_rewards_give_exact_zeros(scale: bool) -> None:
    rewards = torch.tensor([0.1, 0.1, 0.1], dtype=torch.float64)
    naive = rewards - rewards.mean()  # 0.1 * 3 / 3 != 0.1 in binary: rounding noise
    assert (naive != 0).all()
    got = group_advantages(rewards, scale=scale)
    assert torch.equal(got, torch.zeros(3, dtype=torch.float64))
    assert (got == 0.0).all()


def test_is_degenerate() -> None:
    assert is_degenerate(torch.tensor([0.3, 0.3, 0.3]))
    assert is_degenerate(torch.tensor([1.0]))  # one rollout: nothing to compare with
    assert is_degenerate(torch.tensor([]))
    assert not is_degenerate(torch.tensor([0.3, 0.3, 0.30001]))
    assert group_advantages(torch.tensor([1.0]), scale=True).tolist() == [0.0]


def test_integer_rewards_become_floats() -> None:
    assert group_advantages(torch.tensor([0, 1]), scale=False).tolist() == [-0.5, 0.5]


# --------------------------------------------------------------------------- losses by hand
#
# B = 2 sequences, T = 3 positions; advantages A = [1, -2].
#   new logprobs  L = [[-1.0, -0.5, -2.0], [-0.2, -1.5, -0.7]]
#   ratios        r = [[ 1.0,  1.5,  NaN], [ 0.5,  1.1,  2.0]]   (old = L - ln r; NaN: old unknown -> r = 1)
#   mask            = [[   1,    1,    1], [   1,    1,    0]]   (5 trained tokens)
#
# PPO clip, ε = ε_high = 0.2 (grpo, dr_grpo, ppo): per token -min(r·A, clip(r, 0.8, 1.2)·A)
#   row 0 (A = 1):  r=1 -> -1;  r=1.5 -> -min(1.5, 1.2) = -1.2 (clipped high);  r=1 -> -1     sum -3.2
#   row 1 (A = -2): r=0.5 -> -min(-1.0, -1.6) = 1.6 (clipped low);  r=1.1 -> 2.2;  masked     sum  3.8
#   grpo    = mean(-3.2/3, 3.8/2) = (-16/15 + 19/10) / 2 = 5/12
#   dr_grpo = (-3.2 + 3.8) / (B · max_completion_length = 2 · 4) = 0.075
#   ppo     = 0.6 / 5 tokens = 0.12
# dapo, ε = 0.2, ε_high = 0.28: row 0's r=1.5 clips at 1.28 -> sum -3.28; row 1 unchanged 3.8
#   dapo    = 0.52 / 5 = 0.104
# cispo, ε = 1, ε_high = 4: weight clip(r, 0, 5) = r; per token -r·A·L
#   row 0: -(1)(1)(-1) = 1;  -(1.5)(1)(-0.5) = 0.75;  -(1)(1)(-2) = 2                          sum  3.75
#   row 1: -(0.5)(-2)(-0.2) = -0.2;  -(1.1)(-2)(-1.5) = -3.3;  masked                          sum -3.5
#   cispo   = 0.25 / 5 = 0.05
# ratio mean over trained tokens = (1 + 1.5 + 1 + 0.5 + 1.1) / 5 = 1.02
# clip fraction (PPO variants): row 0 t1 and row 1 t0, 2 of 5 = 0.4; cispo: none in [0, 5] clipped.

NEW = [[-1.0, -0.5, -2.0], [-0.2, -1.5, -0.7]]
RATIOS = [[1.0, 1.5, float("nan")], [0.5, 1.1, 2.0]]
MASK = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
ADV = [1.0, -2.0]


def hand_inputs(**extra: object) -> LossInputs:
    new = torch.tensor(NEW, dtype=torch.float64, requires_grad=True)  # [2,3]
    old = new.detach() - torch.tensor(RATIOS, dtype=torch.float64).log()  # [2,3], NaN stays NaN
    return LossInputs(
        logprobs=new,
        old_logprobs=old,
        advantages=torch.tensor(ADV, dtype=torch.float64),
        mask=torch.tensor(MASK, dtype=torch.float64),
        **extra,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(
    ("config", "loss", "clip_fraction"),
    [
        (LossConfig(name="grpo"), 5 / 12, 0.4),
        (LossConfig(name="dr_grpo", max_completion_length=4), 0.075, 0.4),
        (LossConfig(name="ppo"), 0.12, 0.4),
        (LossConfig(name="dapo"), 0.104, 0.4),
        (LossConfig(name="cispo"), 0.05, 0.0),
    ],
    ids=lambda v: v.name if isinstance(v, LossConfig) else None,
)
def test_loss_by_hand(config: LossConfig, loss: float, clip_fraction: float) -> None:
    out = select_loss(config)(hand_inputs())
    assert out.loss.item() == pytest.approx(loss, abs=1e-12)
    assert out.ratio_mean.item() == pytest.approx(1.02, abs=1e-12)
    assert out.clip_fraction.item() == pytest.approx(clip_fraction, abs=1e-12)
    assert out.kl_mean is None
    assert not out.ratio_mean.requires_grad and not out.clip_fraction.requires_grad


def test_kl_term_by_hand() -> None:
    # ref - new = ln 2 everywhere: k3 = e^{ln 2} - ln 2 - 1 = 1 - ln 2 = 0.306853 per token; grpo's
    # per-sequence means each grow by 0.1 · 0.306853, so the loss is 5/12 + 0.0306853.
    new = torch.tensor(NEW, dtype=torch.float64)
    out = select_loss(LossConfig(name="grpo", kl_coef=0.1))(hand_inputs(ref_logprobs=new + math.log(2)))
    assert out.loss.item() == pytest.approx(5 / 12 + 0.1 * (1 - math.log(2)), abs=1e-12)
    assert out.kl_mean is not None and out.kl_mean.item() == pytest.approx(1 - math.log(2), abs=1e-12)
    with pytest.raises(ValueError, match="ref_logprobs"):
        select_loss(LossConfig(name="grpo", kl_coef=0.1))(hand_inputs())


def test_truncated_importance_sampling_by_hand() -> None:
    # Sampler 3x less likely than "old" on row 0 t0: weight min(exp(ln 3), 1.5) = 1.5, so that token's
    # -1 becomes -1.5; elsewhere sampler = old (weight 1) or unknown (NaN: weight 1).
    # grpo = (-3.7/3 + 3.8/2) / 2 = (-37/30 + 57/30) / 2 = 1/3
    inputs = hand_inputs()
    sampler = inputs.old_logprobs.clone()
    sampler[0, 0] -= math.log(3)
    sampler[1, 1] = float("nan")
    config = LossConfig(name="grpo", truncated_importance_sampling=1.5)
    out = select_loss(config)(hand_inputs(sampler_logprobs=sampler))
    assert out.loss.item() == pytest.approx(1 / 3, abs=1e-12)


def test_step_wide_normalisers() -> None:
    # Two micro-batches of one step: each divides by the step's counts, so the halves add up.
    config = LossConfig(name="dapo")
    whole = select_loss(config)(hand_inputs()).loss
    full = hand_inputs()
    halves = []
    for rows in (slice(0, 1), slice(1, 2)):
        part = LossInputs(
            logprobs=full.logprobs[rows],
            old_logprobs=full.old_logprobs[rows],
            advantages=full.advantages[rows],
            mask=full.mask[rows],
            num_sequences=2,
            num_tokens=5,
        )
        halves.append(select_loss(config)(part).loss)
    assert (halves[0] + halves[1]).item() == pytest.approx(whole.item(), abs=1e-12)
    grpo = LossConfig(name="grpo")
    parts = [
        select_loss(grpo)(
            LossInputs(
                logprobs=full.logprobs[r],
                old_logprobs=full.old_logprobs[r],
                advantages=full.advantages[r],
                mask=full.mask[r],
                num_sequences=2,
            )
        ).loss
        for r in (slice(0, 1), slice(1, 2))
    ]
    assert (parts[0] + parts[1]).item() == pytest.approx(5 / 12, abs=1e-12)


def test_config_defaults_and_validation() -> None:
    assert (LossConfig(name="grpo").epsilon, LossConfig(name="grpo").epsilon_high) == (0.2, 0.2)
    assert (LossConfig(name="dapo").epsilon, LossConfig(name="dapo").epsilon_high) == (0.2, 0.28)
    assert (LossConfig().name, LossConfig().epsilon, LossConfig().epsilon_high) == ("cispo", 1.0, 4.0)
    assert LossConfig(name="ppo", epsilon=0.1).epsilon_high == 0.1  # symmetric stays symmetric
    assert LossConfig(name="dapo", epsilon=0.1).epsilon_high == 0.28
    with pytest.raises(ValueError, match="max_completion_length"):
        LossConfig(name="dr_grpo")
    with pytest.raises(ValueError, match="unknown loss"):
        LossConfig(name="reinforce")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        LossConfig(kl_coef=-1.0)


ALL_CONFIGS = [
    LossConfig(name="grpo"),
    LossConfig(name="dr_grpo", max_completion_length=8),
    LossConfig(name="dapo"),
    LossConfig(name="cispo"),
    LossConfig(name="ppo"),
]


@pytest.mark.parametrize("config", ALL_CONFIGS, ids=lambda c: c.name)
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_gradient_direction(config: LossConfig, sign: float) -> None:
    # On-policy (old = new): a positive advantage must raise the logprob of its trained tokens
    # (descent direction -grad > 0), a negative one lower it; untrained tokens get no gradient.
    new = torch.tensor([[-1.0, -2.0, -0.5, -3.0]], requires_grad=True)  # [1,4]
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0]])  # [1,4]
    inputs = LossInputs(
        logprobs=new,
        old_logprobs=torch.full_like(new, float("nan")),  # unknown: ratio 1
        advantages=torch.tensor([sign]),
        mask=mask,
    )
    select_loss(config)(inputs).loss.backward()
    assert new.grad is not None
    assert (-new.grad[0, 1:3] * sign > 0).all()
    assert (new.grad[0, [0, 3]] == 0).all()


@pytest.mark.parametrize("config", ALL_CONFIGS, ids=lambda c: c.name)
def test_zero_advantage_gives_no_gradient(config: LossConfig) -> None:
    new = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    inputs = LossInputs(
        logprobs=new, old_logprobs=new.detach() + 0.1, advantages=torch.zeros(1), mask=torch.ones(1, 2)
    )
    out = select_loss(config)(inputs)
    out.loss.backward()
    assert out.loss.item() == 0.0
    assert new.grad is not None and (new.grad == 0).all()


# --------------------------------------------------------------------------- against TRL 1.16


def _trl_loss(
    loss_type: str,
    new: torch.Tensor,
    old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    epsilon_low: float,
    epsilon_high: float,
    beta: float = 0.0,
    ref: torch.Tensor | None = None,
    max_completion_length: int | None = None,
) -> tuple[torch.Tensor, dict]:
    """``GRPOTrainer._compute_loss`` called unbound on a stand-in holding just what it reads."""
    from trl import GRPOTrainer

    batch, length = new.shape

    def identity(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        return tensor

    def per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, **kwargs):
        assert logits_to_keep == length
        return new, torch.zeros_like(new), None

    metrics: defaultdict = defaultdict(lambda: defaultdict(list))
    trainer = SimpleNamespace(
        loss_type=loss_type,
        epsilon_low=epsilon_low,
        epsilon_high=epsilon_high,
        beta=beta,
        importance_sampling_level="token",
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        aux_loss_enabled=False,
        _entropy_bonus_enabled=False,
        max_completion_length=max_completion_length,
        current_gradient_accumulation_steps=1,
        model=SimpleNamespace(training=True),
        accelerator=SimpleNamespace(
            num_processes=1,
            sync_gradients=True,
            gather=identity,
            reduce=identity,
            gather_for_metrics=identity,
        ),
        _metrics=metrics,
        args=SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1),
        _get_per_token_logps_and_entropies=per_token_logps_and_entropies,
    )
    inputs = {
        "prompt_ids": torch.zeros(batch, 2, dtype=torch.long),
        "prompt_mask": torch.ones(batch, 2, dtype=mask.dtype),
        "completion_ids": torch.zeros(batch, length, dtype=torch.long),
        "completion_mask": mask,
        "advantages": advantages,
        "old_per_token_logps": old,
        "num_items_in_batch": mask.sum(),
    }
    if beta:
        inputs["ref_per_token_logps"] = ref
    loss = GRPOTrainer._compute_loss(trainer, trainer.model, inputs)
    return loss, metrics["train"]


def _random_batch(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    batch, length = 6, 9
    new = -3 * torch.rand(batch, length, generator=gen, dtype=torch.float64)  # [B,T]
    old = new + 0.8 * torch.randn(batch, length, generator=gen, dtype=torch.float64)  # ratios ~0.1..10
    ref = new + 0.3 * torch.randn(batch, length, generator=gen, dtype=torch.float64)
    mask = (torch.rand(batch, length, generator=gen) < 0.7).to(torch.float64)  # [B,T]
    mask[:, 0] = 1.0  # every row trains at least one token
    advantages = torch.randn(batch, generator=gen, dtype=torch.float64)  # [B]
    return {"new": new, "old": old, "ref": ref, "mask": mask, "advantages": advantages}


TRL_CASES = [
    # (ours, TRL loss_type, TRL epsilon_low, TRL epsilon_high, TRL beta)
    (LossConfig(name="grpo"), "grpo", 0.2, 0.2, 0.0),
    (LossConfig(name="dr_grpo", max_completion_length=12), "dr_grpo", 0.2, 0.2, 0.0),
    (LossConfig(name="dapo"), "dapo", 0.2, 0.28, 0.0),
    (LossConfig(name="dapo", epsilon=0.1, epsilon_high=0.3), "dapo", 0.1, 0.3, 0.0),
    # TRL's cispo clamps at `epsilon_high` itself: ours is 1 + ε_high (and 1 - ε = 0 clips nothing).
    (LossConfig(name="cispo"), "cispo", 1.0, 1.0 + 4.0, 0.0),
    (LossConfig(name="cispo", epsilon_high=0.5), "cispo", 1.0, 1.5, 0.0),
    (LossConfig(name="grpo", kl_coef=0.04), "grpo", 0.2, 0.2, 0.04),
]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(
    ("config", "loss_type", "eps_low", "eps_high", "beta"),
    TRL_CASES,
    ids=[f"{c.name}-{i}" for i, (c, *_rest) in enumerate(TRL_CASES)],
)
def test_agrees_with_trl(
    config: LossConfig, loss_type: str, eps_low: float, eps_high: float, beta: float, seed: int
) -> None:
    data = _random_batch(seed)
    ours_new = data["new"].clone().requires_grad_(True)
    ours = select_loss(config)(
        LossInputs(
            logprobs=ours_new,
            old_logprobs=data["old"],
            advantages=data["advantages"],
            mask=data["mask"],
            ref_logprobs=data["ref"],
        )
    )
    ours.loss.backward()

    trl_new = data["new"].clone().requires_grad_(True)
    trl_loss, trl_metrics = _trl_loss(
        loss_type,
        trl_new,
        data["old"],
        data["advantages"],
        data["mask"],
        epsilon_low=eps_low,
        epsilon_high=eps_high,
        beta=beta,
        ref=data["ref"],
        max_completion_length=config.max_completion_length,
    )
    trl_loss.backward()

    assert ours.loss.item() == pytest.approx(trl_loss.item(), abs=1e-6)
    assert ours_new.grad is not None and trl_new.grad is not None
    torch.testing.assert_close(ours_new.grad, trl_new.grad, atol=1e-6, rtol=0)
    if loss_type != "cispo":
        clip = trl_metrics["clip_ratio/region_mean"][0]
        assert ours.clip_fraction.item() == pytest.approx(clip, abs=1e-6)
    if beta:
        assert ours.kl_mean is not None
        assert ours.kl_mean.item() == pytest.approx(trl_metrics["kl"][0], abs=1e-6)
