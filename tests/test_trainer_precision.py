"""The trainer's passes in bf16 autocast (``services.trainer.precision``): when ``auto`` turns it
on, that the weights and optimizer stay float32 while the passes run in bf16, and that a policy
trained that way from bf16 samples, corrected by truncated importance sampling, still learns."""

from __future__ import annotations

import contextlib
import copy
import math

import pytest
import torch

from artery.schemas import Message, TrainConfig, TrainSFTConfig, Trajectory
from artery.services.trainer import policy as policy_module
from artery.services.trainer.logprobs import next_token_logprobs
from artery.services.trainer.policy import LoraSettings, OptimSettings, Policy
from artery.services.trainer.precision import autocast, autocast_dtype, frozen_weights_cast
from artery.shared.cpu import cpu_has_bf16
from artery.shared.tiny_model import tiny_model_path
from artery.testing.tasks import half_alphabet_groups

CAP = 2.0
MAX_SEQ_LEN = 256
CPU, GPU = torch.device("cpu"), torch.device("cuda", 0)

pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.mark.parametrize(
    ("mode", "device", "weights", "corrected", "bf16_cpu", "expected"),
    [
        ("auto", CPU, torch.float32, True, True, torch.bfloat16),  # a bf16 sampler, a bf16 CPU
        ("auto", CPU, torch.float32, False, True, None),  # samples trained as they are: exact float32
        ("auto", CPU, torch.float32, True, False, None),  # bf16 without the instructions is slow
        ("auto", CPU, torch.bfloat16, True, True, None),  # the weights are bf16 already
        ("auto", GPU, torch.float32, True, True, None),  # a GPU's policy picks its own dtype
        ("bfloat16", CPU, torch.float32, False, False, torch.bfloat16),  # asked for: always
        ("bfloat16", GPU, torch.float32, False, False, torch.bfloat16),
        ("off", CPU, torch.float32, True, True, None),
    ],
)
def test_when_the_passes_autocast(mode, device, weights, corrected, bf16_cpu, expected):
    assert autocast_dtype(mode, device, weights, corrected=corrected, bf16_cpu=bf16_cpu) == expected


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="auto, bfloat16, off"):
        autocast_dtype("fp8", CPU, torch.float32, corrected=True, bf16_cpu=True)


@pytest.fixture(scope="module")
def model_path():
    return tiny_model_path()


def make_policy(model_path) -> Policy:
    return Policy.create(model_path, LoraSettings(), OptimSettings(micro_batch_size=16), seed=0)


def bf16_sampled_groups(policy: Policy) -> list:
    """Half-alphabet groups sampled by the policy as a bf16 replica serves it (2 x 8, <= 8 tokens)."""
    return half_alphabet_groups(copy.deepcopy(policy.model).to(torch.bfloat16).eval(), policy.tokenizer)


def test_autocast_logprobs_are_the_float32_ones_to_bf16_precision(model_path):
    """The passes really run in bf16 (the logprobs differ from float32's), the log-softmax in
    float32 (they differ by bf16's rounding, not more), and the result is float32."""
    policy = make_policy(model_path)
    ids = policy.tokenizer.encode("the quick brown fox jumps over the lazy dog")
    batch = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}
    batch["assistant_mask"] = torch.ones(1, len(ids) - 1)
    with torch.no_grad():
        exact = next_token_logprobs(policy.model, batch, 1.0)  # [1,T-1]
        with autocast(CPU, torch.bfloat16):
            mixed = next_token_logprobs(policy.model, batch, 1.0)  # [1,T-1]
    assert mixed.dtype == torch.float32
    gap = float((mixed - exact).abs().max())
    assert 0.0 < gap < 0.1, gap


def test_a_bf16_step_trains_float32_weights(model_path):
    policy = make_policy(model_path)
    before = {n: p.detach().clone() for n, p in policy.named_trainable}
    torch.manual_seed(1)
    groups = bf16_sampled_groups(policy)
    config = TrainConfig(learning_rate=1e-2, truncated_importance_sampling=CAP)
    result = policy.train_step(groups, config, max_seq_len=MAX_SEQ_LEN, autocast_mode="bfloat16")
    assert result.trained and result.metrics["autocast_bf16"] == 1.0
    assert all(p.dtype == torch.float32 for _, p in policy.named_trainable)
    assert policy.weights_dtype == torch.float32
    assert max(float((p - before[n]).abs().max()) for n, p in policy.named_trainable) > 0.0
    states = [s for s in policy.optimizer.state.values() if "exp_avg" in s]
    assert states and all(s["exp_avg"].dtype == torch.float32 for s in states)


@pytest.mark.parametrize("cap", [None, CAP])
def test_auto_autocasts_corrected_steps_on_a_bf16_cpu(model_path, cap):
    """``auto`` as the trainer service runs it: this machine's CPU decides, the cap too."""
    policy = make_policy(model_path)
    torch.manual_seed(1)
    groups = bf16_sampled_groups(policy)
    config = TrainConfig(learning_rate=1e-2, truncated_importance_sampling=cap)
    result = policy.train_step(groups, config, max_seq_len=MAX_SEQ_LEN, autocast_mode="auto")
    assert result.trained
    assert result.metrics["autocast_bf16"] == float(cap is not None and cpu_has_bf16())


def test_learns_from_bf16_samples_in_bf16_passes(model_path):
    """Sampled each step by a bf16 copy of the policy, trained in bf16 autocast with TIS at cap 2:
    the half-alphabet reward goes from ~0.4 to >= 0.8 within 60 steps, as the float32 trainer's
    (``test_sampler_mismatch``)."""
    torch.manual_seed(0)
    policy = make_policy(model_path)
    config = TrainConfig(learning_rate=1e-2, loss_fn="cispo", truncated_importance_sampling=CAP)
    curve = []
    for _ in range(60):
        result = policy.train_step(
            bf16_sampled_groups(policy), config, max_seq_len=MAX_SEQ_LEN, autocast_mode="bfloat16"
        )
        curve.append(round(result.metrics["reward_mean"], 3))
        if curve[-1] >= 0.8:
            break
    print("half-alphabet reward by step (bf16 sampler, bf16-autocast trainer, TIS):", curve)
    assert curve[0] < 0.6
    assert curve[-1] >= 0.8, curve


@pytest.mark.parametrize(("mode", "bf16"), [("auto", 0.0), ("bfloat16", 1.0)])
def test_sft_autocasts_only_when_asked(model_path, mode, bf16):
    """SFT has no sampler to correct for: ``auto`` keeps it float32, ``bfloat16`` is obeyed."""
    policy = make_policy(model_path)
    chat = Trajectory(
        messages=[Message(role="user", content="spell abc"), Message(role="assistant", content="a b c")]
    )
    config = TrainSFTConfig(learning_rate=1e-3, batch_size=2)
    result = policy.sft_step([chat, chat], config, max_seq_len=MAX_SEQ_LEN, autocast_mode=mode)
    assert result.trained and math.isfinite(result.metrics["loss"])
    assert result.metrics["autocast_bf16"] == bf16


def test_frozen_weights_are_cast_once_and_put_back(model_path):
    """Inside ``frozen_weights_cast`` the base model's Linear weights are their bf16 casts and the
    adapter's stay float32; after it, the very same parameters. Without a dtype, nothing moves."""
    policy = make_policy(model_path)
    model = policy.model
    before = dict(model.named_parameters(remove_duplicate=False))
    frozen = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and not m.weight.requires_grad]
    originals = [m.weight for m in frozen]
    assert frozen
    with frozen_weights_cast(model, torch.bfloat16):
        assert all(
            torch.equal(m.weight, w.to(torch.bfloat16)) for m, w in zip(frozen, originals, strict=True)
        )
        assert all(p.dtype == torch.float32 for _, p in policy.named_trainable)
    after = dict(model.named_parameters(remove_duplicate=False))
    assert after.keys() == before.keys() and all(after[n] is before[n] for n in before)
    with frozen_weights_cast(model, None):
        assert all(m.weight is w for m, w in zip(frozen, originals, strict=True))


def test_a_weight_two_layers_share_is_cast_once():
    shared = torch.nn.Linear(4, 4, bias=False).requires_grad_(False)
    twin = torch.nn.Linear(4, 4, bias=False)
    twin.weight = shared.weight  # tied, as an output projection to its embedding
    model = torch.nn.Sequential(shared, twin)
    with frozen_weights_cast(model, torch.bfloat16):
        assert shared.weight.dtype == torch.bfloat16 and shared.weight is twin.weight
    assert shared.weight.dtype == torch.float32 and shared.weight is twin.weight


@pytest.mark.parametrize("loss_fn", ["cispo", "ppo"])
def test_a_step_with_frozen_weights_cast_once_trains_what_autocast_trains(model_path, monkeypatch, loss_fn):
    """The same bf16 step with each pass casting the base model itself (autocast alone) and with it
    cast once per update: the same loss and the same adapter, to the bit."""
    torch.manual_seed(1)
    groups = bf16_sampled_groups(make_policy(model_path))
    config = TrainConfig(learning_rate=1e-2, loss_fn=loss_fn, truncated_importance_sampling=CAP)
    results, adapters = [], []
    for cast in (lambda model, dtype: contextlib.nullcontext(), frozen_weights_cast):
        monkeypatch.setattr(policy_module, "frozen_weights_cast", cast)
        policy = Policy.create(model_path, LoraSettings(), OptimSettings(micro_batch_size=4), seed=0)
        results.append(policy.train_step(groups, config, max_seq_len=MAX_SEQ_LEN, autocast_mode="bfloat16"))
        adapters.append({n: p.detach().clone() for n, p in policy.named_trainable})
    assert all(r.trained for r in results)
    assert results[0].metrics["loss"] == results[1].metrics["loss"]
    assert all(torch.equal(adapters[0][n], adapters[1][n]) for n in adapters[0])
