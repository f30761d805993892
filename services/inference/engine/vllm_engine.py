"""The vLLM engine (GPU): continuous batching, LoRA hot-load, sleep/wake for a shared GPU.

Installed only by the ``gpu`` extra (vLLM pins its own torch); nothing imports this module
unless ``ARTERY_INFERENCE_ENGINE=vllm``. Logprobs are requested in ``processed_logprobs`` mode
so that they are those of the sampling distribution (temperature applied), exactly like the
transformers engine's, and the trainer's importance ratios compare like with like.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from artery.services.inference.engine.base import (
    Completion,
    EngineError,
    GenerationRequest,
    SamplingParams,
    TokenStep,
    UnknownAdapter,
)


class VLLMEngine:
    kind = "vllm"

    def __init__(
        self,
        model_path: str | Path,
        *,
        max_context: int | None = None,
        gpu_memory_utilization: float = 0.85,
        max_lora_rank: int = 64,
        max_loras: int = 4,
        enable_sleep_mode: bool = True,
        engine_args: dict[str, Any] | None = None,
    ):
        self.model_path = str(model_path)
        self._args = dict(
            model=self.model_path,
            enable_lora=True,
            max_lora_rank=max_lora_rank,
            max_loras=max_loras,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_sleep_mode=enable_sleep_mode,
            logprobs_mode="processed_logprobs",
            **({"max_model_len": max_context} if max_context else {}),
            **(engine_args or {}),
        )
        self._engine = None
        self._loras: dict[str, Any] = {}  # served name -> LoRARequest
        self._lora_ids = itertools.count(1)
        self._sleeping = False
        self.tokenizer = None
        self.max_context = max_context or 0

    async def start(self) -> None:
        from transformers import AutoTokenizer
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self._engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**self._args))
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.max_context = self._engine.model_config.max_model_len

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
            logprobs=max(params.top_logprobs, 0) if params.logprobs else 0,
            output_kind=RequestOutputKind.DELTA,
        )

    async def stream(self, request: GenerationRequest) -> AsyncIterator[TokenStep]:
        from vllm import TokensPrompt

        if self._engine is None:
            raise EngineError("engine not started")
        lora = None
        if request.adapter is not None:
            lora = self._loras.get(request.adapter)
            if lora is None:
                raise UnknownAdapter(request.adapter)
        async for output in self._engine.generate(
            TokensPrompt(prompt_token_ids=request.prompt_token_ids),
            self._sampling_params(request.params),
            request_id=request.request_id or uuid.uuid4().hex,
            lora_request=lora,
        ):
            for choice in output.outputs:
                steps = list(
                    zip(choice.token_ids, choice.logprobs or [None] * len(choice.token_ids), strict=False)
                )
                for position, (token_id, alternatives) in enumerate(steps):
                    last = position == len(steps) - 1 and choice.finish_reason is not None
                    top = sorted(
                        ((tid, lp.logprob) for tid, lp in (alternatives or {}).items()),
                        key=lambda item: -item[1],
                    )[: request.params.top_logprobs]
                    sampled = (alternatives or {}).get(token_id)
                    yield TokenStep(
                        index=choice.index,
                        token_id=token_id,
                        logprob=sampled.logprob if sampled is not None else float("nan"),
                        top_logprobs=top,
                        finish_reason=("length" if choice.finish_reason == "length" else "stop")
                        if last
                        else None,
                    )

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
            for stop in request.params.stop:  # vLLM already cut the text; keep it for safety
                if stop and stop in c.text:
                    c.text = c.text[: c.text.index(stop)]
        return [completions[i] for i in sorted(completions)]

    async def load_adapter(self, name: str, path: Path) -> None:
        from vllm.lora.request import LoRARequest

        if any(Path(path).glob("*.bin")) or any(Path(path).glob("*.pt")):
            raise EngineError(f"refusing a pickled adapter in {path}: safetensors only")
        request = LoRARequest(lora_name=name, lora_int_id=next(self._lora_ids), lora_path=str(path))
        await self._engine.add_lora(request)
        self._loras[name] = request

    async def unload_adapter(self, name: str) -> None:
        request = self._loras.pop(name, None)
        if request is not None:
            await self._engine.remove_lora(request.lora_int_id)

    def adapters(self) -> list[str]:
        return list(self._loras)

    async def sleep(self) -> bool:
        """Level 1: offload weights to CPU, drop the KV cache; the trainer gets the GPU memory."""
        if self._engine is None or self._sleeping:
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
