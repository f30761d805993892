"""LoRA slots in a trainer worker (#30): models on one base model share its weights, each with
its own adapter and optimizer; steps interleaved between models, or a model evicted and restored
from its saved step, give what each model trained alone gives.

The tiny model, in this process, through ``PolicyCache`` as the trainer service uses it (resume,
train, save the step, advance), against fresh ``Policy`` objects trained on the same data.
"""

from __future__ import annotations

import gc
import json
import shutil
import warnings
import weakref
from pathlib import Path

import pytest
import torch

from artery.schemas import LoraSpec, ModelRecord, TrainConfig, Trajectory, new_event_id
from artery.services.trainer import slots as slots_module
from artery.services.trainer.checkpoints import (
    PolicyCache,
    lora_settings,
    optim_settings,
    save_step,
    step_dir,
)
from artery.services.trainer.policy import Policy
from artery.services.trainer.settings import TrainerSettings
from artery.shared.models import TINY, resolve_base_model
from tests.test_trainer_policy import scored_groups, trajectory

PROJECT = "demo"
MAX_SEQ_LEN = 256
LEARNING_RATE = 1e-2
#: Another adapter shape than the trainer's default (rank 8, alpha 16, every projection + lm_head).
SMALL_LORA = LoraSpec(rank=4, alpha=8, target_modules=["q_proj", "v_proj"])

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def other_base(tmp_path: Path) -> Path:
    """Other weights (a copy of the tiny model, in another directory): a base of their own."""
    other = tmp_path / "other-base"
    shutil.copytree(resolve_base_model(TINY), other)
    return other


@pytest.fixture(scope="module")
def data() -> dict[str, list[list[Trajectory]]]:
    """Two models' training data: different answers and rewards, so their updates differ. The
    logprobs are the base model's, which every fresh adapter is (LoRA B = 0)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        policy = Policy.create(resolve_base_model(TINY), seed=0)
    return {
        "a": scored_groups(policy),
        "b": [
            [
                trajectory(policy, "green leaves fall", 0.1),
                trajectory(policy, "ok", 0.8),
                trajectory(policy, "the quick brown fox", 0.5),
            ]
        ],
    }


def settings(tmp_path, slots: int, bases: int = 1) -> TrainerSettings:
    return TrainerSettings(
        checkpoint_dir=str(tmp_path / "checkpoints"),
        max_seq_len=MAX_SEQ_LEN,
        lora_slots=slots,
        base_model_slots=bases,
    )


def record(name: str, lora: LoraSpec | None = None, base_model: str = TINY) -> ModelRecord:
    return ModelRecord(project=PROJECT, name=name, base_model=base_model, trainable=True, lora=lora)


async def train(
    cache: PolicyCache, model: ModelRecord, groups: list[list[Trajectory]], autocast_mode: str = "off"
) -> Policy:
    """One step as the trainer service takes it: resume, train, save the step, advance."""
    policy, step = await cache.get(model)
    result = policy.train_step(
        groups, TrainConfig(learning_rate=LEARNING_RATE), max_seq_len=MAX_SEQ_LEN, autocast_mode=autocast_mode
    )
    assert result.trained and result.step == step + 1
    save_step(cache.settings, model, policy, step + 1, new_event_id(), result.metrics)
    cache.advance(model, step + 1)
    return policy


def alone(
    trainer: TrainerSettings,
    model: ModelRecord,
    steps: list[list[list[Trajectory]]],
    autocast_mode: str = "off",
) -> Policy:
    """The model trained in a fresh policy of its own (a base model to itself), step by step."""
    base = resolve_base_model(model.base_model or TINY)
    policy = Policy.create(base, lora_settings(trainer, model), optim_settings(trainer), seed=0)
    for groups in steps:
        assert policy.train_step(
            groups,
            TrainConfig(learning_rate=LEARNING_RATE),
            max_seq_len=MAX_SEQ_LEN,
            autocast_mode=autocast_mode,
        ).trained
    return policy


def state(policy: Policy) -> dict[str, torch.Tensor]:
    """The adapter's weights (keys without the adapter's name) and the AdamW state, by parameter."""
    from peft import get_peft_model_state_dict

    weights = get_peft_model_state_dict(
        policy.model, adapter_name=policy.adapter_name, save_embedding_layers=False
    )
    moments = {
        f"optimizer {index}.{key}": value.detach().clone()
        for index, entries in policy.optimizer.state_dict()["state"].items()
        for key, value in entries.items()
        if isinstance(value, torch.Tensor)
    }
    return {**{f"adapter {k}": v.detach().clone() for k, v in weights.items()}, **moments}


def assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], atol: float = 1e-6) -> None:
    assert got.keys() == want.keys() and any(k.startswith("optimizer") for k in got)
    worst = max(float((got[k].float() - want[k].float()).abs().max()) for k in got)
    assert worst <= atol, worst


def differs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return any(not torch.equal(a[k], b[k]) for k in a.keys() & b.keys() if k.startswith("adapter"))


def base_weight(policy: Policy) -> torch.Tensor:
    return policy.model.get_input_embeddings().weight


@pytest.fixture
def base_loads(monkeypatch) -> list[str]:
    """The base models the slots load from disk, in order."""
    loaded: list[str] = []
    real = slots_module.load_base

    def counting(path, dtype, device):
        loaded.append(path)
        return real(path, dtype, device)

    monkeypatch.setattr(slots_module, "load_base", counting)
    return loaded


async def test_two_models_on_one_base_share_one_copy_of_its_weights(tmp_path, base_loads):
    cache = PolicyCache(settings(tmp_path, slots=4, bases=2))
    first, _ = await cache.get(record("a"))
    second, _ = await cache.get(record("b", SMALL_LORA))
    assert len(base_loads) == 1 and len(cache.slots.bases()) == 1
    assert first.model is second.model
    assert base_weight(first).data_ptr() == base_weight(second).data_ptr()
    assert first.adapter_name != second.adapter_name

    other = other_base(tmp_path)
    third, _ = await cache.get(record("c", base_model=str(other)))
    assert len(base_loads) == 2 and third.model is not first.model

    cache.forget()  # the model last asked for (a failed step's) only
    assert cache.slots.get((PROJECT, "c")) is None and len(cache.slots) == 2
    again, _ = await cache.get(record("a"))
    assert again is first and len(base_loads) == 2


@pytest.mark.parametrize("autocast_mode", ["off", "bfloat16"])
async def test_interleaved_models_train_as_each_would_alone(tmp_path, data, base_loads, autocast_mode):
    """In bf16 autocast too: there the frozen weights are cast for the step (``precision``), and
    which of a shared base's LoRA weights are frozen depends on the model that trains."""
    trainer = settings(tmp_path, slots=4)
    cache = PolicyCache(trainer)
    a, b = record("a"), record("b")
    await train(cache, a, data["a"], autocast_mode)
    policy_b = await train(cache, b, data["b"], autocast_mode)
    before = state(policy_b)
    await train(cache, a, data["a"], autocast_mode)
    assert_close(state(policy_b), before, atol=0.0)  # A's step left B's adapter and optimizer alone
    await train(cache, b, data["b"], autocast_mode)
    assert len(base_loads) == 1

    policy_a, step_a = await cache.get(a)
    policy_b, step_b = await cache.get(b)
    assert step_a == step_b == 2 and policy_a.model is policy_b.model
    assert_close(state(policy_a), state(alone(trainer, a, [data["a"]] * 2, autocast_mode)))
    assert_close(state(policy_b), state(alone(trainer, b, [data["b"]] * 2, autocast_mode)))
    assert differs(state(policy_a), state(policy_b))

    trained = state(policy_b)
    cache.forget(b)  # restored beside A, from its saved step: the same again
    restored, _ = await cache.get(b)
    assert restored is not policy_b and restored.model is policy_a.model
    assert_close(state(restored), trained, atol=0.0)


async def test_an_evicted_model_resumes_as_if_it_had_stayed(tmp_path, data, base_loads):
    trainer = settings(tmp_path, slots=1)
    cache = PolicyCache(trainer)
    a, b = record("a"), record("b")
    evicted = await train(cache, a, data["a"])
    await train(cache, b, data["b"])  # takes the only slot: A's adapter goes, the base stays
    assert cache.slots.get((PROJECT, "a")) is None and len(cache.slots.bases()) == 1
    assert evicted.adapter_name not in evicted.model.peft_config
    resumed = await train(cache, a, data["a"])  # restored from its saved step 1
    assert resumed is not evicted and resumed.step == 2
    assert len(base_loads) == 1  # the base was kept for the model that came in

    never_evicted = PolicyCache(settings(tmp_path / "kept", slots=4))
    for model, groups in ((a, data["a"]), (b, data["b"]), (a, data["a"])):
        kept = await train(never_evicted, model, groups)
    assert_close(state(resumed), state(kept))


async def test_a_model_of_another_lora_shape_shares_the_base(tmp_path, data):
    trainer = settings(tmp_path, slots=4)
    cache = PolicyCache(trainer)
    wide, small = record("wide"), record("small", SMALL_LORA)
    for _ in range(2):
        policy_wide = await train(cache, wide, data["a"])
        policy_small = await train(cache, small, data["b"])
    assert policy_wide.model is policy_small.model
    assert len(policy_small.named_trainable) == 8 < len(policy_wide.named_trainable)  # A, B of q, v x 2
    assert_close(state(policy_wide), state(alone(trainer, wide, [data["a"]] * 2)))
    assert_close(state(policy_small), state(alone(trainer, small, [data["b"]] * 2)))

    # Saved as a policy of its own saves it: what inference loads, where it loads it from, and a
    # checkpoint that restores anywhere (a fresh worker, the processes of a distributed step).
    saved = step_dir(trainer, small, 2)
    files = list((saved / "adapter").iterdir())
    assert {p.name for p in files} >= {"adapter_config.json", "adapter_model.safetensors"}
    assert not [p for p in files if p.is_dir()]  # no sub-folder named after the adapter
    config = json.loads((saved / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], sorted(config["target_modules"])) == (4, ["q_proj", "v_proj"])
    restored = Policy.restore(
        saved, resolve_base_model(TINY), lora_settings(trainer, small), optim_settings(trainer)
    )
    assert restored.step == 2
    assert_close(state(restored), state(policy_small), atol=0.0)


async def test_evicting_the_last_model_of_a_base_frees_it(tmp_path):
    cache = PolicyCache(settings(tmp_path, slots=1))
    first, _ = await cache.get(record("a"))
    freed = weakref.ref(base_weight(first))
    del first
    other = other_base(tmp_path)
    await cache.get(record("b", base_model=str(other)))
    gc.collect()
    assert freed() is None and len(cache.slots.bases()) == 1


async def test_a_warm_start_shares_the_base_of_the_adapter_it_starts_from(tmp_path, data, base_loads):
    trainer = settings(tmp_path, slots=4)
    started = alone(trainer, record("origin"), [data["a"]])  # an adapter trained elsewhere
    warm_dir = Policy.adapter_dir(started.save(tmp_path / "origin"))
    cache = PolicyCache(trainer)
    plain, warm = record("plain"), record("warm", base_model=str(warm_dir))
    policy_plain, _ = await cache.get(plain)
    policy_warm = await train(cache, warm, data["b"])
    assert policy_warm.model is policy_plain.model and len(base_loads) == 1
    assert_close(state(policy_warm), state(alone(trainer, warm, [data["b"]])))


async def test_a_model_on_another_base_evicts_the_held_bases_models_first(tmp_path, base_loads):
    """One base-model slot (the default): a base is a whole model's weights, so a model on
    another base evicts the held base's models (least recently used first) and frees it, though
    LoRA slots are left."""
    cache = PolicyCache(settings(tmp_path, slots=4))
    first, _ = await cache.get(record("a"))
    await cache.get(record("b"))
    freed = weakref.ref(base_weight(first))
    del first
    other = other_base(tmp_path)
    await cache.get(record("c", base_model=str(other)))
    gc.collect()
    assert freed() is None and len(cache.slots.bases()) == 1 and len(base_loads) == 2
    assert [cache.slots.get((PROJECT, m)) is None for m in "abc"] == [True, True, False]
