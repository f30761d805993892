"""Who the serving comparison runs and how: Artery's replicas (the default serving path's
environment is ``default_serving_env``), vLLM's own OpenAI server with an Artery engine's
arguments or with ``BEST_CPU``, the candidates ``--sweep`` measures for it, and ``Servers``
(started and stopped by name, the replicas in a private stack)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from artery.ops.stack import Stack, inference_python
from artery.ops.stack_engine import replica_engine
from artery.shared.cpu import cpu_has_bf16
from artery.shared.embedded import free_port, stop_process
from artery.shared.models import SMOLLM2, resolve_base_model
from loadtests.serving_result import serve_flags, stock_vllm_args

PROJECT = "bench"
MODEL = "infer"


def default_serving_env(base_model: str = SMOLLM2) -> dict[str, str]:
    """The replica environment of Artery's default serving path on this machine: what
    ``LocalBackend`` and the demos choose for ``base_model`` (``artery.ops.stack_engine``), asked of the
    choice itself. The rest (max LoRA rank, KV cache...) is the engine's own settings."""
    return replica_engine(base_model, dict(os.environ)).env


#: The dtype vLLM-CPU serves fastest in on this CPU: bf16 with bf16 instructions, else float32
#: (bf16 matmuls without them take a slow path, ``stack_engine``).
BEST_DTYPE = "bfloat16" if cpu_has_bf16() else "float32"


#: Artery's replica on the vLLM engine with nothing set: the engine's defaults (float32 on the CPU).
ENGINE_DEFAULTS_ENV = {"ARTERY_INFERENCE_ENGINE": "vllm"}
TRANSFORMERS_ENV = {"ARTERY_INFERENCE_ENGINE": "transformers"}


@dataclass(frozen=True)
class ServeFlags:
    """How to start vLLM's own OpenAI server: its flags and its environment."""

    args: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        return " ".join([*(f"{k}={v}" for k, v in sorted(self.env.items())), *self.args])


#: vLLM-CPU's fastest own server for SmolLM2 on a 2-core CPU: ``BEST_DTYPE``, no LoRA, and vLLM's own
#: defaults otherwise (chunked prefill on; automatic binding: one OMP thread on one core, the other
#: left to the API server and scheduler), which beat binding both cores, no binding and chunked
#: prefill off in ``--sweep`` (docs/results/2026-11-28-serving-comparison.md).
BEST_CPU = ServeFlags(
    args=("--dtype", BEST_DTYPE),
    env={"VLLM_CPU_KVCACHE_SPACE": "2"},
)

#: Candidates for ``BEST_CPU``, measured two at a time by ``--sweep`` (label -> flags).
SWEEP: dict[str, ServeFlags] = {
    f"{BEST_DTYPE}, vLLM's defaults (auto binding: 1 OMP thread, 1 core reserved)": BEST_CPU,
    f"{BEST_DTYPE}, OMP threads on both cores": ServeFlags(
        ("--dtype", BEST_DTYPE), {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
    ),
    f"{BEST_DTYPE}, no thread binding": ServeFlags(
        ("--dtype", BEST_DTYPE), {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    ),
    f"{BEST_DTYPE}, chunked prefill off": ServeFlags(
        ("--dtype", BEST_DTYPE, "--no-enable-chunked-prefill"), {"VLLM_CPU_KVCACHE_SPACE": "2"}
    ),
    f"{BEST_DTYPE}, KV cache 1 GiB": ServeFlags(("--dtype", BEST_DTYPE), {"VLLM_CPU_KVCACHE_SPACE": "1"}),
    # What LoRA costs vLLM-CPU before its kernels run: with LoRA on it serves eagerly (no
    # torch.compile), and Artery's engine turns chunked prefill off.
    f"{BEST_DTYPE}, eager (no torch.compile)": ServeFlags(
        ("--dtype", BEST_DTYPE, "--compilation-config", '{"mode": 0}'), {"VLLM_CPU_KVCACHE_SPACE": "2"}
    ),
    f"{BEST_DTYPE}, eager, chunked prefill off": ServeFlags(
        ("--dtype", BEST_DTYPE, "--compilation-config", '{"mode": 0}', "--no-enable-chunked-prefill"),
        {"VLLM_CPU_KVCACHE_SPACE": "2"},
    ),
}

# --- the servers --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Contender:
    name: str
    what: str
    #: Artery's replica environment, or None for vLLM's own server / in-process.
    replica_env: dict[str, str] | None = None
    serve: ServeFlags | None = None

    def describe(self) -> dict:
        out: dict = {"what": self.what}
        if self.replica_env is not None:
            out["replica_env"] = self.replica_env
        if self.serve is not None:
            out["server"] = "python -m vllm.entrypoints.openai.api_server"
            out["flags"] = self.serve.describe()
        return out


_ENGINE_ARGS = """
import json
from artery.services.inference.main import make_engine
from artery.services.inference.settings import PREFIX, InferenceSettings
from artery.shared.settings import load
engine = make_engine(load(InferenceSettings, PREFIX))
print(json.dumps({"args": engine.engine_args(),
                  "kv_cache_memory_bytes": engine.engine_config().cache_config.kv_cache_memory_bytes}))
"""


def engine_serve_flags(replica_env: dict[str, str], base_model: str, stock: bool = False) -> ServeFlags:
    """The vLLM server flags matching what Artery's vLLM engine gives vLLM under ``replica_env``:
    asked of the engine itself, in the vLLM interpreter its replicas run under. ``stock``: without
    the arguments that load Artery's own code into vLLM (``stock_vllm_args``)."""
    env = {
        **os.environ,
        "ARTERY_INFERENCE_PROJECT": PROJECT,
        "ARTERY_INFERENCE_MODEL": MODEL,
        "ARTERY_INFERENCE_BASE_MODEL": base_model,
        **replica_env,
    }
    done = subprocess.run(
        [inference_python(env), "-c", _ENGINE_ARGS], env=env, capture_output=True, text=True, timeout=300
    )
    if done.returncode:
        raise RuntimeError(f"reading the vLLM engine's arguments failed:\n{done.stderr[-2000:]}")
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    args = stock_vllm_args(answer["args"]) if stock else answer["args"]
    if kv := os.environ.get("VLLM_CPU_KVCACHE_SPACE"):  # given here: the replica and the server get it
        return ServeFlags(serve_flags(args), {"VLLM_CPU_KVCACHE_SPACE": kv})
    # The replica sizes its KV cache itself (none on a GPU); vLLM's server gets the same size.
    return ServeFlags(serve_flags({**args, "kv_cache_memory_bytes": answer["kv_cache_memory_bytes"]}), {})


def contenders(base_model: str, names: set[str], threads: int | None = None) -> dict[str, Contender]:
    """The contenders named; ``threads`` limits the transformers replica's torch threads (vLLM
    binds its own)."""
    default_env = default_serving_env(base_model)
    transformers_env = {
        **TRANSFORMERS_ENV,
        **({"ARTERY_INFERENCE_TORCH_THREADS": str(threads)} if threads else {}),
    }
    out = {
        "hf_generate": Contender("hf_generate", "HF model.generate, in-process, float32, one call a round"),
        "artery_transformers": Contender(
            "artery_transformers", "Artery replica, transformers engine", replica_env=transformers_env
        ),
        "artery_vllm": Contender(
            "artery_vllm", "Artery replica, vLLM engine, its defaults", replica_env=ENGINE_DEFAULTS_ENV
        ),
        "artery_default": Contender(
            "artery_default", "Artery replica, the default serving path", replica_env=default_env
        ),
        "vllm_cpu_best": Contender("vllm_cpu_best", "vllm serve, fastest flags here", serve=BEST_CPU),
    }
    if "vllm_serve" in names:
        out["vllm_serve"] = Contender(
            "vllm_serve",
            "vllm serve, artery_vllm's engine args",
            serve=engine_serve_flags(ENGINE_DEFAULTS_ENV, base_model),
        )
    if "vllm_serve_lora" in names:
        # vLLM's own LoRA serving at the default path's engine args; where the default is not
        # vLLM (a CPU without bf16 instructions), at the vLLM engine's own defaults.
        on_vllm = default_env.get("ARTERY_INFERENCE_ENGINE") == "vllm"
        out["vllm_serve_lora"] = Contender(
            "vllm_serve_lora",
            f"vllm serve, {'artery_default' if on_vllm else 'artery_vllm'}'s engine args, vLLM's own LoRA",
            serve=engine_serve_flags(default_env if on_vllm else ENGINE_DEFAULTS_ENV, base_model, stock=True),
        )
    return {n: c for n, c in out.items() if n in names}


class Servers:
    """Artery replicas (in a private stack) and vLLM servers, started and stopped by name."""

    def __init__(self, stack: Stack, base_model: str, home: Path):
        self.stack = stack
        self.base_model = base_model
        self.model_path = resolve_base_model(base_model)
        self.home = home
        self.popen: dict[str, subprocess.Popen] = {}
        self.urls: dict[str, str] = {}
        self.vllm_python = inference_python(dict(ENGINE_DEFAULTS_ENV))

    def start(self, c: Contender) -> None:
        if c.replica_env is not None:
            self.stack.start_service(
                c.name,
                service="inference",
                env={
                    "ARTERY_INFERENCE_PROJECT": PROJECT,
                    "ARTERY_INFERENCE_MODEL": MODEL,
                    "ARTERY_INFERENCE_BASE_MODEL": self.base_model,
                    "ARTERY_INFERENCE_REPLICA_ID": c.name,
                    **c.replica_env,
                },
            )
            return
        assert c.serve is not None
        port = free_port()
        with open(self.log(c.name), "ab") as log:
            self.popen[c.name] = subprocess.Popen(
                [self.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_path,
                 "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port), *c.serve.args],
                env={**os.environ, **c.serve.env},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        self.urls[c.name] = f"http://127.0.0.1:{port}"

    def wait(self, name: str, timeout_s: float = 900) -> None:
        if name in self.stack.processes:
            process = self.stack.processes[name]
            process.wait_ready(timeout_s)
            self.urls[name] = process.ready_info["url"]
        else:
            asyncio.run(_wait_http(self.urls[name], self.popen[name], timeout_s))

    def pid(self, name: str) -> int | None:
        if name in self.stack.processes:
            proc = self.stack.processes[name].proc
            return proc.pid if proc else None
        return self.popen[name].pid if name in self.popen else None

    def stop(self, name: str) -> None:
        if name in self.stack.processes:
            process = self.stack.processes.pop(name)
            process.signal(signal.SIGTERM)
            process.stop(timeout=30)
        elif name in self.popen:
            stop_process(self.popen.pop(name), signal.SIGTERM, 30)
        self.urls.pop(name, None)

    def stop_all(self) -> None:
        for name in [*self.stack.processes, *self.popen]:
            self.stop(name)

    def log(self, name: str) -> Path:
        return self.stack.logs / f"{name}.log"


async def _wait_http(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=5) as client:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the vLLM server exited with code {proc.returncode}")
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(f"{url}/v1/models")).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} not up within {timeout_s}s")
            await asyncio.sleep(0.5)
