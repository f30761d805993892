"""ART's Megatron settings (``art.MegatronRuntimeConfig`` and friends), accepted and kept.

ART's ``MegatronBackend`` trains large models with Megatron-LM's tensor, context, expert and
pipeline parallelism. Artery has no Megatron: its trainer scales out with ``torch.distributed``
(one LoRA step over data-parallel ranks). So these objects validate and remember what a program
sets, as ART's do, and the first use says once that they change nothing here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from artery.utils.art_settings import note_no_effect

_WHY = "Artery has no Megatron; its trainer scales out with torch.distributed (data-parallel LoRA)"


def _visible_device_count() -> int:
    # ART's default for context and expert parallelism: every visible GPU (1 without torch or CUDA).
    try:
        import torch
    except ImportError:
        return 1
    return max(int(torch.cuda.device_count()), 1)


def _at_least_one(owner: str, **values: int | None) -> None:
    for name, value in values.items():
        if value is not None and value < 1:
            raise ValueError(f"{owner}.{name} must be >= 1, got {value}")


class MegatronTopologyConfig(msgspec.Struct, kw_only=True, frozen=True):
    """Megatron's parallel degrees: tensor, context, expert, pipeline, virtual pipeline, expert-tensor."""

    tp: int = 1
    cp: int = msgspec.field(default_factory=_visible_device_count)
    ep: int = msgspec.field(default_factory=_visible_device_count)
    pp: int = 1
    vpp: int | None = None
    etp: int = 1

    def __post_init__(self) -> None:
        _at_least_one(
            "MegatronTopologyConfig",
            tp=self.tp,
            cp=self.cp,
            ep=self.ep,
            pp=self.pp,
            vpp=self.vpp,
            etp=self.etp,
        )


class MegatronRuntimeConfig(msgspec.Struct, kw_only=True, frozen=True):
    """ART's Megatron run settings: a topology and the packed sequence length (required)."""

    topology: MegatronTopologyConfig
    packed_sequence_length: int
    streaming_weight_offload: bool = False

    def __post_init__(self) -> None:
        _at_least_one("MegatronRuntimeConfig", packed_sequence_length=self.packed_sequence_length)


_runtime_config: MegatronRuntimeConfig | None = None


def init_megatron_runtime_config(
    config: MegatronRuntimeConfig | Mapping[str, Any] | None = None,
    *,
    topology: MegatronTopologyConfig | Mapping[str, int | None] | None = None,
    packed_sequence_length: int | None = None,
    snapshot_pool_capacity: int = 2,
    streaming_weight_offload: bool = False,
) -> MegatronRuntimeConfig:
    """Set the process's Megatron settings once, as ART does (the same again is fine; other
    settings raise ``ValueError``). Nothing in Artery reads them: said once, as a warning."""
    global _runtime_config
    note_no_effect("MegatronRuntimeConfig", _WHY)
    if config is None:
        config = {
            "topology": topology if topology is not None else MegatronTopologyConfig(),
            "packed_sequence_length": packed_sequence_length,
            "streaming_weight_offload": streaming_weight_offload,
        }
    if not isinstance(config, MegatronRuntimeConfig):
        fields = dict(config)
        if isinstance(fields.get("topology"), MegatronTopologyConfig):
            fields["topology"] = msgspec.structs.asdict(fields["topology"])
        try:
            config = msgspec.convert(fields, MegatronRuntimeConfig)
        except msgspec.ValidationError as exc:
            raise ValueError(f"MegatronRuntimeConfig: {exc}") from None
    if _runtime_config is None:
        _runtime_config = config
    elif _runtime_config != config:
        raise ValueError(
            f"Megatron runtime config is already initialized with {_runtime_config}, got {config}."
        )
    return _runtime_config


def get_megatron_runtime_config() -> MegatronRuntimeConfig:
    """The settings ``init_megatron_runtime_config`` set; ``RuntimeError`` before it, as ART."""
    if _runtime_config is None:
        raise RuntimeError(
            "Call art.init_megatron_runtime_config(...) first. Note: " + _WHY + ", so the settings"
            " are only kept, never used."
        )
    return _runtime_config
