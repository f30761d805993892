"""Inference replica settings, read from ``ARTERY_INFERENCE_*`` (plus the common ``ARTERY_*``)."""

from __future__ import annotations

import os
import socket
import uuid
from typing import Annotated, Literal

import msgspec

from artery.schemas.base import NAME_PATTERN
from artery.shared.settings import doc

PREFIX = "ARTERY_INFERENCE_"
#: A long multi-turn request at a 128k-token context is about 0.5-1.5 MB of JSON (3-6 bytes a token,
#: escapes and tools included): 8 MiB leaves room for that several times over, and anything larger is
#: refused before it is read, so no body bigger than this is ever held or tokenised.
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
#: Rows the transformers engine decodes together unless told otherwise (``max_batch_size``). Wide:
#: a row decoded beside others saves a pass over all the weights, and a CPU's matrix products run
#: far faster on 32-64 rows than on 16 (docs/results). Each row keeps its own KV cache, so lower it
#: for long contexts on a big model.
DEFAULT_MAX_BATCH_SIZE = 64


def default_replica_id() -> str:
    host = "".join(c if c.isalnum() or c in "-_" else "-" for c in socket.gethostname())[:32]
    return f"{host}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class InferenceSettings(msgspec.Struct, kw_only=True, frozen=True):
    project: Annotated[str, doc("project whose model this replica serves", pattern=NAME_PATTERN)]
    model: Annotated[str, doc("model name served as <model> and <model>@<step>", pattern=NAME_PATTERN)]
    base_model: Annotated[str, doc("base weights: a directory, artery/tiny-random, or a cached hub name")]
    engine: Annotated[Literal["transformers", "vllm"], doc("inference engine")] = "transformers"
    device: Annotated[str, doc("transformers engine device: cpu, cuda, cuda:1")] = "cpu"
    host: Annotated[str, doc("address the HTTP API listens on")] = "127.0.0.1"
    port: Annotated[int, doc("HTTP port; 0 picks a free one", ge=0, le=65535)] = 0
    public_url: Annotated[str | None, doc("URL clients reach this replica at (default http://host:port)")] = (
        None
    )
    api_key: Annotated[str | None, doc("require `Authorization: Bearer <key>` on /v1")] = None
    api_key_file: Annotated[
        str | None, doc("file holding the API key (a secure stack's per-project key, docker secrets)")
    ] = None
    max_body_bytes: Annotated[
        int, doc("largest request body accepted; a larger one gets 413 before it is read", ge=1024)
    ] = DEFAULT_MAX_BODY_BYTES
    max_batch_size: Annotated[
        int, doc("sequences decoded together (transformers engine); each keeps its own KV cache", ge=1)
    ] = DEFAULT_MAX_BATCH_SIZE
    dtype: Annotated[
        Literal["float32", "bfloat16", "float16"] | None,
        doc(
            "weights dtype (default: bf16 on a GPU; on the CPU float32 for transformers, bf16 for vllm,"
            " ~2x its float32; float16 on the CPU with transformers: fp16 weights, float32 arithmetic;"
            " the trainer corrects bf16 and fp16 samples with truncated importance sampling)"
        ),
    ] = None
    max_lora_rank: Annotated[
        int,
        doc("largest LoRA rank the vllm engine serves; vLLM computes at this rank: keep it small", ge=1),
    ] = 16
    gpu_memory_utilization: Annotated[
        float,
        doc(
            "share of the GPU's memory the vllm engine takes (weights and KV cache); lower it when"
            " the GPU is shared with another replica or a trainer that trains while the replica is awake",
            gt=0,
            le=1,
        ),
    ] = 0.85
    enforce_eager: Annotated[
        bool,
        doc(
            "vllm engine: no torch.compile (nor CUDA graphs): starts faster, serves slower; on the CPU"
            " LoRA serving is compiled otherwise (the first start of a model compiles it, then it is cached)"
        ),
    ] = False
    default_max_tokens: Annotated[int, doc("completion length when a request sets none", ge=1)] = 1024
    max_pause_wait_s: Annotated[float, doc("how long a request waits while paused before a 503", gt=0)] = (
        600.0
    )
    drain_timeout_s: Annotated[float, doc("time in-flight requests get to finish on pause", gt=0)] = 20.0
    heartbeat_s: Annotated[
        float, doc("replica registry heartbeat (entries expire after 30 s)", gt=0, lt=30)
    ] = 5.0
    replica_id: Annotated[str, doc("this replica's id in the registry")] = msgspec.field(
        default_factory=default_replica_id
    )
    adapter_cache_dir: Annotated[str | None, doc("where fetched adapters are unpacked")] = None
    load_saved_adapters: Annotated[
        bool,
        doc(
            "load an adapter as soon as the trainer has saved it (from the trainer-state object"
            " store), before the publisher has published it; if unreadable, once it is published"
        ),
    ] = True
    max_checkpoint_lag_s: Annotated[
        float,
        doc("longest time serving an older step than the newest published before /health is 503", gt=0),
    ] = 60.0
    torch_threads: Annotated[
        int,
        doc("CPU threads torch may use (0: torch's default, every core); set it when sharing cores", ge=0),
    ] = 0
