"""An unloaded adapter's layers serve the next load of the same config (``engine.lora``): each
step of a training loop loads step N+1 and then unloads step N, and PEFT would build the layers
anew every time. What a reused adapter serves must be exactly what a fresh load serves."""

from __future__ import annotations

import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from artery.services.inference.engine.base import EngineError, UnknownAdapter
from artery.services.inference.engine.lora import LoraSet
from artery.shared.tiny_model import tiny_model_path
from tests.test_engine_transformers import save_random_adapter

PROMPT = torch.tensor([[1, 5, 9, 14, 3, 7]])


@pytest.fixture(scope="module")
def model_path():
    return tiny_model_path()


def base(model_path):
    return AutoModelForCausalLM.from_pretrained(model_path).eval()


@pytest.fixture(scope="module")
def adapters(model_path, tmp_path_factory):
    """Three adapters of one config (a, b, c) and one of another rank (wide)."""
    made = {name: tmp_path_factory.mktemp(name) for name in ("a", "b", "c", "wide")}
    for seed, name in enumerate(("a", "b", "c")):
        save_random_adapter(model_path, made[name], seed=seed)
    save_random_adapter(model_path, made["wide"], seed=3, rank=8)
    return made


def logits(lora: LoraSet, name: str | None) -> torch.Tensor:
    with torch.no_grad(), lora.active(name) as model:
        return model(PROMPT).logits


@pytest.fixture(scope="module")
def fresh(model_path, adapters):
    """Each adapter's logits, loaded alone into a model of its own."""
    out = {}
    for name, path in adapters.items():
        lora = LoraSet(base(model_path))
        lora.load(f"{name}@1", path)
        out[name] = logits(lora, f"{name}@1")
    lora = LoraSet(base(model_path))
    out[None] = logits(lora, None)
    return out


def test_a_training_loops_steps_reuse_the_layers_of_the_step_before(model_path, adapters, fresh):
    lora = LoraSet(base(model_path))
    lora.load("m@1", adapters["a"])
    for step, name in enumerate(("b", "c", "a", "b"), start=2):
        adapters_before = set(lora.model.peft_config)
        lora.load(f"m@{step}", adapters[name])
        lora.unload(f"m@{step - 1}")
        assert torch.equal(logits(lora, f"m@{step}"), fresh[name]), f"step {step} serves other weights"
        assert lora.names() == [f"m@{step}"]
        if step > 2:  # from the second swap on, step N+1 fills the layers step N-1 left
            assert set(lora.model.peft_config) == adapters_before, "the layers were built anew"
    with pytest.raises(UnknownAdapter):
        logits(lora, "m@4")  # an unloaded name is gone, whatever its layers serve now


def test_another_config_gets_layers_of_its_own(model_path, adapters, fresh):
    lora = LoraSet(base(model_path))
    lora.load("m@1", adapters["a"])
    lora.load("m@2", adapters["b"])
    lora.unload("m@1")  # a spare of rank 4
    lora.load("wide@1", adapters["wide"])
    assert torch.equal(logits(lora, "wide@1"), fresh["wide"])
    assert torch.equal(logits(lora, "m@2"), fresh["b"])
    lora.load("m@3", adapters["c"])  # the rank-4 spare, kept while the rank-8 load went past it
    assert torch.equal(logits(lora, "m@3"), fresh["c"])
    assert len(lora.model.peft_config) == 3


def test_weights_that_do_not_fill_the_layers_load_as_peft_loads_them(model_path, adapters, tmp_path):
    """Same config, one tensor missing: the spare is dropped and PEFT loads the adapter as it
    would have without spares (here: that layer's B stays zero)."""
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "adapter_config.json").write_bytes((adapters["c"] / "adapter_config.json").read_bytes())
    weights = load_file(adapters["c"] / "adapter_model.safetensors")
    dropped = next(key for key in sorted(weights) if "lora_B" in key)
    save_file({k: v for k, v in weights.items() if k != dropped}, partial / "adapter_model.safetensors")
    alone = LoraSet(base(model_path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        alone.load("p@1", partial)
    expected = logits(alone, "p@1")

    lora = LoraSet(base(model_path))
    lora.load("m@1", adapters["a"])
    lora.load("m@2", adapters["b"])
    lora.unload("m@1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lora.load("p@1", partial)
    assert torch.equal(logits(lora, "p@1"), expected)
    assert set(lora.names()) == {"m@2", "p@1"}
    assert len(lora.model.peft_config) == 2, "the spare that did not fit is still there"


def test_the_last_unload_leaves_the_base_model_alone(model_path, adapters, fresh):
    lora = LoraSet(base(model_path))
    lora.load("m@1", adapters["a"])
    lora.load("m@2", adapters["b"])
    lora.unload("m@1")
    lora.unload("m@2")
    assert not hasattr(lora.model, "peft_config"), "LoRA layers left in the base model"
    assert torch.equal(logits(lora, None), fresh[None])
    lora.load("m@3", adapters["c"])
    assert torch.equal(logits(lora, "m@3"), fresh["c"])


def test_a_preload_fills_a_spare_and_serves_only_once_named(model_path, adapters, fresh):
    """The replica reads a staged step ahead (``preload``) and names it once saved: the read takes
    the spare step N-1 left, and nothing serves it under its key."""
    lora = LoraSet(base(model_path))
    lora.load("m@1", adapters["a"])
    lora.load("m@2", adapters["b"])
    lora.unload("m@1")  # a spare
    layers_before = set(lora.model.peft_config)
    lora.preload("m@3 staged", adapters["c"])
    assert set(lora.model.peft_config) == layers_before, "the preload built layers anew"
    assert lora.names() == ["m@2"]
    with pytest.raises(UnknownAdapter):
        logits(lora, "m@3 staged")
    lora.serve_preloaded("m@3", "m@3 staged")
    assert torch.equal(logits(lora, "m@3"), fresh["c"])
    assert torch.equal(logits(lora, "m@2"), fresh["b"])
    with pytest.raises(UnknownAdapter):
        lora.serve_preloaded("m@4", "m@3 staged")  # a key is served once


def test_a_dropped_preload_leaves_a_spare_and_holds_the_layers_meanwhile(model_path, adapters, fresh):
    lora = LoraSet(base(model_path))
    lora.load("m@1", adapters["a"])
    lora.preload("m@2 staged", adapters["b"])
    lora.unload("m@1")  # not the last: the preload keeps the LoRA layers in
    assert hasattr(lora.model, "peft_config")
    assert torch.equal(logits(lora, None), fresh[None])
    lora.drop_preloaded("m@2 staged")  # the last: the base model alone again
    assert not hasattr(lora.model, "peft_config"), "LoRA layers left in the base model"
    lora.drop_preloaded("never preloaded")  # a preload that failed has nothing to drop

    lora.load("m@3", adapters["c"])
    lora.preload("m@4 staged", adapters["a"])
    lora.drop_preloaded("m@4 staged")  # a newer step came: its layers are kept as a spare
    layers_before = set(lora.model.peft_config)
    lora.load("m@5", adapters["b"])
    assert set(lora.model.peft_config) == layers_before, "the dropped preload's layers were not reused"
    assert torch.equal(logits(lora, "m@5"), fresh["b"])


def test_a_key_preloaded_twice_is_refused(model_path, adapters):
    lora = LoraSet(base(model_path))
    lora.preload("k", adapters["a"])
    with pytest.raises(EngineError, match="already preloaded"):
        lora.preload("k", adapters["b"])


def test_a_name_replaced_keeps_its_layers_and_serves_until_the_new_one_is_in(
    model_path, adapters, fresh, tmp_path
):
    """The only adapter replaced under its own name: the new one is read in first, so the old one
    retires as a spare rather than taking the LoRA layers out; a replacement that fails leaves
    the old one served."""
    lora = LoraSet(base(model_path))
    lora.load("m", adapters["a"])
    lora.load("m", adapters["b"])  # layers built beside a's, a's kept as a spare
    layers_before = set(lora.model.peft_config)
    lora.load("m", adapters["c"])  # fills a's spare
    assert set(lora.model.peft_config) == layers_before, "the layers were built anew"
    assert torch.equal(logits(lora, "m"), fresh["c"])

    lora.preload("m staged", adapters["a"])  # fills b's spare
    lora.serve_preloaded("m", "m staged")
    assert set(lora.model.peft_config) == layers_before, "the spares went with the replaced adapter"
    assert torch.equal(logits(lora, "m"), fresh["a"])

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text("{}")
    (broken / "adapter_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(EngineError):
        lora.load("m", broken)
    assert lora.names() == ["m"]
    assert torch.equal(logits(lora, "m"), fresh["a"])
