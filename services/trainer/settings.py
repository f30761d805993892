"""Trainer settings, read from ``ARTERY_TRAINER_*`` (plus the common ``ARTERY_*``)."""

from __future__ import annotations

from typing import Annotated

import msgspec

from artery.shared.settings import doc

PREFIX = "ARTERY_TRAINER_"


class TrainerSettings(msgspec.Struct, kw_only=True, frozen=True):
    checkpoint_dir: Annotated[
        str, doc("where adapters and optimizer state are saved (shared with the publisher)")
    ] = ".artery/checkpoints"
    device: Annotated[str, doc("torch device: cpu, cuda, cuda:1")] = "cpu"
    max_seq_len: Annotated[int, doc("longest training sequence; longer ones are cut or dropped", ge=16)] = (
        2048
    )
    micro_batch_size: Annotated[int, doc("sequences per forward/backward (gradient accumulation)", ge=1)] = 8
    temperature: Annotated[float, doc("sampling temperature the logprobs are computed at", gt=0)] = 1.0
    lora_rank: Annotated[int, doc("LoRA rank", ge=1)] = 8
    lora_alpha: Annotated[int, doc("LoRA alpha", ge=1)] = 16
    lora_target_modules: Annotated[
        str, doc("comma-separated modules to adapt (lm_head included: tiny models need it)")
    ] = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,lm_head"
    pause_lease_s: Annotated[float, doc("lease of the inference pause; renewed while training", gt=0)] = 120.0
    pause_timeout_s: Annotated[float, doc("how long to wait for every replica's pause ack", gt=0)] = 30.0
    group_wait_s: Annotated[
        float, doc("how long a train request waits for its groups to be stored", gt=0)
    ] = 120.0
    ack_wait_s: Annotated[
        float,
        doc("silence before a request is redelivered (a running step renews it: crashes show soon)", gt=0),
    ] = 60.0
    torch_threads: Annotated[
        int,
        doc("CPU threads torch may use (0: torch's default, every core); set it when sharing cores", ge=0),
    ] = 0
