"""A checkpoint's safetensors files built in memory are the bytes ``safetensors`` writes."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from artery.services.trainer.optimizer_state import rng_state
from artery.services.trainer.tensor_bytes import safetensors_bytes

EVERY_DTYPE = {
    "bool": torch.tensor([True, False]),
    "u8": torch.arange(7, dtype=torch.uint8),
    "i8": torch.tensor([-1, 2], dtype=torch.int8),
    "i16": torch.tensor([300, -300], dtype=torch.int16),
    "f16": torch.tensor([0.5, 1.5], dtype=torch.float16),
    "bf16": torch.tensor([2.0, -3.0], dtype=torch.bfloat16),
    "i32": torch.tensor([1 << 20], dtype=torch.int32),
    "f32": torch.randn(3, 4, generator=torch.Generator().manual_seed(0)),
    "f64": torch.tensor([1e-300], dtype=torch.float64),
    "i64": torch.arange(5),
}


@pytest.mark.parametrize(
    "tensors",
    [
        EVERY_DTYPE,
        {"b": torch.ones(2), "a": torch.zeros(2), "é": torch.tensor(3.0)},  # order, non-ASCII, 0-dim
        {"empty": torch.zeros(0, 3)},
        {},
        rng_state(),
    ],
    ids=["every dtype", "order and names", "no elements", "no tensors", "rng state"],
)
@pytest.mark.parametrize("metadata", [None, {"format": "pt"}])
def test_the_bytes_are_those_safetensors_writes(tmp_path, tensors, metadata):
    save_file(tensors, tmp_path / "written.safetensors", metadata=metadata)
    built = safetensors_bytes(tensors, metadata)
    assert built == (tmp_path / "written.safetensors").read_bytes()
    (tmp_path / "built.safetensors").write_bytes(built)
    loaded = load_file(tmp_path / "built.safetensors")
    assert loaded.keys() == tensors.keys()
    assert all(torch.equal(loaded[k], t) and loaded[k].dtype == t.dtype for k, t in tensors.items())


def test_a_view_is_written_as_its_elements(tmp_path):
    """safetensors refuses a tensor that is not contiguous; its elements are what is meant."""
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    view = base.t()
    (tmp_path / "t.safetensors").write_bytes(safetensors_bytes({"t": view}))
    assert torch.equal(load_file(tmp_path / "t.safetensors")["t"], view)


def test_a_dtype_safetensors_has_no_name_for_is_refused():
    with pytest.raises(TypeError, match="no safetensors dtype"):
        safetensors_bytes({"c": torch.zeros(2, dtype=torch.complex64)})
