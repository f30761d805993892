"""Trainer settings, read from ``ARTERY_TRAINER_*`` (plus the common ``ARTERY_*``)."""

from __future__ import annotations

import os
import socket
from typing import Annotated, Literal

import msgspec

from artery.shared.settings import doc

PREFIX = "ARTERY_TRAINER_"

#: The training passes' precision (``precision``): auto, bfloat16 or off.
Autocast = Literal["auto", "bfloat16", "off"]


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
    lora_slots: Annotated[
        int,
        doc(
            "models a worker keeps in memory between steps, least recently used evicted (each step"
            " is saved: an evicted model resumes from it); models on the same base model share one"
            " copy of its weights, each its own LoRA adapter and optimizer",
            ge=1,
        ),
    ] = 4
    base_model_slots: Annotated[
        int,
        doc(
            "base models a worker keeps in memory at once (each a whole model's weights): a model"
            " on another base evicts the least recently used models until one fits",
            ge=1,
        ),
    ] = 1
    pause_lease_s: Annotated[float, doc("lease of the inference pause; renewed while training", gt=0)] = 120.0
    pause_timeout_s: Annotated[float, doc("how long to wait for every replica's pause ack", gt=0)] = 30.0
    group_wait_s: Annotated[
        float,
        doc(
            "how long a train request may wait for its groups to be stored (handed back meanwhile:"
            " it never holds the trainer); then train.failed, retriable",
            gt=0,
        ),
    ] = 120.0
    ack_wait_s: Annotated[
        float,
        doc("silence before a request is redelivered (a running step renews it: crashes show soon)", gt=0),
    ] = 60.0
    world_size: Annotated[
        int,
        doc(
            "processes each GRPO step runs data-parallel over (torch.distributed, launched by torchrun:"
            " gloo on cpu, nccl on cuda:0 to cuda:<world_size - 1>); such a step cannot be stopped"
            " midway, it finishes or fails whole. SFT steps train in the service's process",
            ge=1,
        ),
    ] = 1
    torch_threads: Annotated[
        int,
        doc("CPU threads torch may use (0: torch's default, every core); set it when sharing cores", ge=0),
    ] = 0
    autocast: Annotated[
        Autocast,
        doc(
            "precision of the training passes (weights and optimizer stay float32): auto runs them in"
            " bf16 on a CPU with bf16 instructions when the samples are corrected by truncated"
            " importance sampling (a bf16 sampler's); bfloat16 always; off never"
        ),
    ] = "auto"
    # What one request may cost, checked before a tensor is made: a request over any of these
    # fails at once with ``train.failed`` (not retriable) naming the budget and the figures.
    max_request_mib: Annotated[
        int,
        doc("MiB of stored trajectories (their JSON) one request may name, all its groups together", ge=1),
    ] = 64
    max_sampled_turns: Annotated[
        int, doc("sampled assistant turns one trajectory may hold (its additional histories included)", ge=1)
    ] = 64
    max_rendered_mib: Annotated[
        int,
        doc(
            "MiB of conversation the chat template may render for one request (each turn's prompt again)",
            ge=1,
        ),
    ] = 64
    max_group_sequences: Annotated[
        int, doc("training sequences one group may give (a conversation split at a turn gives more)", ge=1)
    ] = 256
    max_request_sequences: Annotated[
        int, doc("training sequences one request may give, all its groups together", ge=1)
    ] = 2048
    max_sequence_tokens: Annotated[
        int, doc("tokens of one sequence before it is cut to max_seq_len; a longer one is refused", ge=16)
    ] = 32768
    max_request_tokens: Annotated[
        int, doc("tokens one request trains on, all its sequences together (after cutting)", ge=16)
    ] = 1_048_576
    max_step_memory_mib: Annotated[
        int,
        doc(
            "estimated memory of a step's largest micro-batch (activations and logits), MiB;"
            " 0: half the machine's memory (the GPU's on cuda)",
            ge=0,
        ),
    ] = 0
    # Whose base weights a model may name: a record is written for an agent, so its base_model is
    # never opened as a path the agent chose.
    base_models: Annotated[
        str | None,
        doc(
            "comma-separated names of the base models a model may be trained on (artery/tiny-random,"
            " a Hugging Face name in the local cache); * for any name or directory. Unset: * on a bus"
            " without authentication (whoever reaches it may write the registry anyway), else the"
            " embedded models' names. Another project's checkpoints are never allowed"
        ),
    ] = None
    warm_start_dir: Annotated[
        str | None,
        doc(
            "directory of adapters a project may warm-start from, <dir>/<project>/<adapter>, beside"
            " its own checkpoints (the same setting as the publisher's ARTERY_PUBLISHER_WARM_START_DIR)"
        ),
    ] = None
    schedule_window: Annotated[
        int,
        doc("pending train requests looked at to pick the next one (round-robin over projects)", ge=1),
    ] = 64
    worker_id: Annotated[
        str | None,
        doc(
            "this worker's name in a pool of trainers (a model's lease names its holder); unique among"
            " running workers: one restarted under the same id takes its former leases over at once."
            " Unset: trainer-<hostname>-<pid>"
        ),
    ] = None


def worker_id(settings: TrainerSettings) -> str:
    """The worker's id: the setting, else one unique to this process."""
    return settings.worker_id or f"trainer-{socket.gethostname()}-{os.getpid()}"
