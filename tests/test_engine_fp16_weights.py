"""fp16 weights under float32 arithmetic on the CPU (``engine.fp16_weights``): the transformers
engine's ``dtype="float16"`` there. What it serves must be the float32 model with each weight
rounded to fp16, LoRA included, and nothing else; on the tiny random model."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM

from artery.services.inference.engine.base import EngineError
from artery.services.inference.engine.fp16_weights import (
    Fp16WeightLinear,
    fp16_weights_available,
    use_fp16_weights,
)
from artery.services.inference.engine.lora import LoraSet
from artery.services.inference.engine.transformers_engine import TransformersEngine
from artery.shared.tiny_model import tiny_model_path
from tests.test_engine_transformers import _prompt, _request, _teacher_forced, save_random_adapter

pytestmark = pytest.mark.skipif(not fp16_weights_available(), reason="needs fbgemm (an x86 build of torch)")

PROMPT = torch.tensor([[1, 5, 9, 14, 3, 7]])


@pytest.fixture(scope="module")
def model_path():
    return tiny_model_path()


@pytest.fixture(scope="module")
def adapter_dir(model_path, tmp_path_factory):
    return save_random_adapter(model_path, tmp_path_factory.mktemp("adapter"), seed=5)


def rounded(model: nn.Module) -> nn.Module:
    """A float32 copy of ``model`` whose Linear weights are rounded to fp16 and back: what fp16
    weights should compute, in plain float32 matmuls."""
    out = copy.deepcopy(model)
    for module in out.modules():
        if type(module) is nn.Linear:
            # A new parameter, not a copy into the old one: a head tied to the embedding rounds
            # its own weight, while the embedding looks up the float32 one, as with fp16 weights.
            module.weight = nn.Parameter(module.weight.detach().half().float(), requires_grad=False)
    return out


def tiny(model_path):
    return AutoModelForCausalLM.from_pretrained(model_path).eval()


def test_a_linear_multiplies_by_its_weight_rounded_to_fp16():
    torch.manual_seed(0)
    layer = nn.Linear(48, 80)
    weight, bias = layer.weight, layer.bias
    x = torch.randn(3, 5, 48)  # [B, T, in]: more than two dimensions pass through
    exact = layer(x)

    assert use_fp16_weights(layer) == 1
    assert type(layer) is Fp16WeightLinear and isinstance(layer, nn.Linear)
    assert layer.weight is weight and layer.bias is bias  # the same parameters, still float32
    out = layer(x)
    assert out.dtype == torch.float32 and out.shape == exact.shape
    assert torch.allclose(out, F.linear(x, weight.half().float(), bias), rtol=0, atol=1e-5)
    assert not torch.equal(out, exact)  # the rounding is real: the fp16 copy is what is multiplied


def test_only_float32_weights_are_packed():
    with pytest.raises(EngineError, match="float32"):
        use_fp16_weights(nn.Linear(8, 8).to(torch.bfloat16))


def test_a_tied_head_stays_tied_and_lora_applies_over_fp16_weights(model_path, adapter_dir):
    model = tiny(model_path)
    expected_base = rounded(model)
    changed = use_fp16_weights(model)
    assert changed == sum(type(m) is Fp16WeightLinear for m in model.modules()) > 0
    assert model.lm_head.weight is model.get_input_embeddings().weight

    served, expected = LoraSet(model), LoraSet(expected_base)
    for lora in (served, expected):
        lora.load("tuned@1", adapter_dir)
    outputs = {}
    with torch.no_grad():
        for name in (None, "tuned@1"):
            with served.active(name) as a, expected.active(name) as b:
                got, want = a(PROMPT).logits, b(PROMPT).logits
            assert torch.allclose(got, want, rtol=0, atol=1e-4), name
            outputs[name] = got
        assert not torch.allclose(outputs[None], outputs["tuned@1"], atol=1e-2)  # the LoRA acts
    served.unload("tuned@1")  # the last adapter out: the base layers stay fp16-weight ones
    assert sum(type(m) is Fp16WeightLinear for m in served.model.modules()) == changed


async def test_the_engine_serves_fp16_weights_with_logprobs_near_float32(model_path, adapter_dir):
    engine = TransformersEngine(model_path, dtype="float16")
    await engine.start()
    try:
        prompt = _prompt(engine)
        [sample] = await engine.generate(_request(prompt, temperature=1.0, seed=3, logprobs=True))
        exact, _ = _teacher_forced(tiny(model_path), prompt, sample.token_ids, 1.0)
        near, _ = _teacher_forced(rounded(tiny(model_path)), prompt, sample.token_ids, 1.0)
        got = torch.tensor(sample.logprobs)
        assert torch.allclose(got, near, rtol=0, atol=1e-4)  # what fp16 weights compute
        assert torch.allclose(got, exact, rtol=0, atol=5e-2)  # and close to the float32 trainer's

        # A row decodes the same tokens alone and beside others; an adapter serves beside them.
        await engine.load_adapter("tuned@1", adapter_dir)
        alone = (await engine.generate(_request(prompt, temperature=1.0, seed=7)))[0].token_ids
        others = [_request(_prompt(engine, f"other {i} " * i), temperature=1.0) for i in range(4)]
        together = await asyncio.gather(
            *[engine.generate(r) for r in others[:2]],
            engine.generate(_request(prompt, temperature=1.0, seed=7)),
            *[engine.generate(r) for r in others[2:]],
        )
        assert together[2][0].token_ids == alone
        base = (await engine.generate(_request(prompt, temperature=0)))[0].token_ids
        tuned = (await engine.generate(_request(prompt, "tuned@1", temperature=0)))[0].token_ids
        assert tuned != base
    finally:
        await engine.close()
