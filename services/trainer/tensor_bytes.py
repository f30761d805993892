"""Tensors as the bytes of a safetensors file, built in memory with one join.

A step's checkpoint goes to the trainer-state store before it goes to disk, so its files are needed
as bytes first. ``safetensors.torch.save`` makes them, but copies every tensor into a Python bytes
object before the library copies them again into the file's buffer; here the file is the header and
a view of each tensor's memory, joined once. The bytes are the ones ``safetensors.torch.save_file``
writes (the same order: the widest dtype first, then by name; the same JSON header, padded to 8
bytes), which ``tests/test_tensor_bytes.py`` checks, so either reader loads them.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping

import torch
from torch import Tensor

#: safetensors' dtype names, in the order of its ``Dtype`` enum (the file sorts the widest first).
_DTYPES: dict[torch.dtype, str] = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int16: "I16",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int32: "I32",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.int64: "I64",
}
_RANK = {dtype: rank for rank, dtype in enumerate(_DTYPES)}


def safetensors_bytes(tensors: Mapping[str, Tensor], metadata: Mapping[str, str] | None = None) -> bytes:
    """``tensors`` as a safetensors file. Tensors on an accelerator are copied to the CPU first."""
    ordered = sorted(tensors.items(), key=lambda item: (-_rank(item[1].dtype), item[0]))
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    views = []
    offset = 0
    for name, tensor in ordered:
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        views.append(data.data)
        header[name] = {
            "dtype": _DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + data.nbytes],
        }
        offset += data.nbytes
    encoded = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    encoded += b" " * (-len(encoded) % 8)
    return b"".join([struct.pack("<Q", len(encoded)), encoded, *views])


def _rank(dtype: torch.dtype) -> int:
    if dtype not in _RANK:
        raise TypeError(f"no safetensors dtype for {dtype}")
    return _RANK[dtype]
