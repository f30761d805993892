"""fp16 weights under float32 arithmetic, for the transformers engine on a CPU.

Decoding a few rows a step, a CPU spends its time reading every weight from memory, not
multiplying: the weights of a small model already outgrow its caches. fbgemm's fp16 matmul
(``torch.ops.quantized.linear_dynamic_fp16``, x86 with AVX2, FMA and F16C) keeps each weight in
fp16, packed for its kernel, and widens it to float32 as it reads: half the bytes, with the
activations, the accumulation and the logits still in float32. fp16 keeps 11 significant bits
(bf16 keeps 8), so the sampled logprobs stay close to the float32 trainer's; the trainer corrects
the rest with truncated importance sampling (``artery.ops.stack_engine``).

Every plain ``nn.Linear`` of the model becomes an :class:`Fp16WeightLinear`: still an
``nn.Linear`` holding the very same float32 parameters (so PEFT wraps it with LoRA as before, and
a head tied to the embedding stays tied), plus the packed fp16 copy that its forward multiplies
by. LoRA's own matrices stay float32. The weights are frozen while a model serves; a changed
weight needs packing again.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from artery.services.inference.engine.base import EngineError


class Fp16WeightLinear(nn.Linear):
    """An ``nn.Linear`` whose forward multiplies by an fp16 copy of its weight (fbgemm)."""

    packed: Any  # fbgemm's packed fp16 weight and bias: an opaque handle, not a tensor

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # nn.Linear's argument name
        return torch.ops.quantized.linear_dynamic_fp16(input, self.packed)


def fp16_weights_available() -> bool:
    """Whether this torch build has fbgemm, which packs and multiplies the fp16 weights."""
    return "fbgemm" in torch.backends.quantized.supported_engines


def use_fp16_weights(model: nn.Module) -> int:
    """Turn every plain ``nn.Linear`` of ``model`` (on the CPU, float32) into an
    :class:`Fp16WeightLinear` in place; how many. Raises ``EngineError`` where fbgemm is missing."""
    if not fp16_weights_available():
        raise EngineError("fp16 weights on the CPU need fbgemm (an x86 build of torch)")
    changed = 0
    for module in model.modules():
        if type(module) is not nn.Linear:
            continue
        if module.weight.dtype != torch.float32 or module.weight.device.type != "cpu":
            raise EngineError(f"fp16 weights are packed from float32 CPU weights, not {module.weight.dtype}")
        bias = module.bias.detach() if module.bias is not None else None
        # The class changes in place: the module keeps its parameters (tied ones included) and its
        # place in the model, and only the forward is new.
        module.__class__ = Fp16WeightLinear
        module.packed = torch.ops.quantized.linear_prepack_fp16(module.weight.detach(), bias)
        changed += 1
    return changed
