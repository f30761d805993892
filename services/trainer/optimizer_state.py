"""AdamW's state and torch's RNG state as safetensors + JSON: a checkpoint restores exactly, no pickle.

``optimizer.safetensors`` holds the tensors as ``"<param index>.<key>"`` (exp_avg, exp_avg_sq,
step); ``optimizer.json`` the param groups (hyperparameters), non-tensor state and parameter names.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def flatten_optimizer_state(
    state_dict: dict[str, Any], param_names: list[str]
) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """``optimizer.state_dict()`` as safetensors tensors (``"<index>.<key>"``) plus a JSON structure."""
    tensors: dict[str, Tensor] = {}
    state: dict[str, dict[str, Any]] = {}
    for index, entries in state_dict["state"].items():
        state[str(index)] = {}
        for key, value in entries.items():
            if isinstance(value, Tensor):
                tensors[f"{index}.{key}"] = value.detach().cpu().contiguous()
                state[str(index)][key] = {"tensor": f"{index}.{key}"}
            else:
                state[str(index)][key] = {"value": value}
    groups = [
        {k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in state_dict["param_groups"]
    ]
    return tensors, {"param_names": param_names, "param_groups": groups, "state": state}


def unflatten_optimizer_state(tensors: dict[str, Tensor], structure: dict[str, Any]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for index, entries in structure["state"].items():
        state[int(index)] = {
            key: tensors[spec["tensor"]] if "tensor" in spec else spec["value"]
            for key, spec in entries.items()
        }
    groups = [{k: tuple(v) if k == "betas" else v for k, v in g.items()} for g in structure["param_groups"]]
    return {"state": state, "param_groups": groups}


def optimizer_steps(optimizer: torch.optim.Optimizer) -> int:
    steps = [float(s["step"]) for s in optimizer.state.values() if "step" in s]
    return int(max(steps)) if steps else 0


def rng_state() -> dict[str, Tensor]:
    state = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, cuda_state in enumerate(torch.cuda.get_rng_state_all()):
            state[f"torch_cuda.{i}"] = cuda_state
    return state


def set_rng_state(state: dict[str, Tensor]) -> None:
    torch.set_rng_state(state["torch_cpu"])
    cuda = [state[k] for k in sorted(state) if k.startswith("torch_cuda.")]
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
