"""The in-process engine: a Hugging Face causal LM with batched decoding and many LoRA adapters.

Requests wait in one queue. A scheduler task takes the oldest one together with every waiting
request for the same adapter (up to ``max_batch_size`` completions, counting ``n``) and decodes
them as one batch on a dedicated model thread, so the event loop stays free. Requests that arrive
meanwhile join the running batch between two decode steps (continuous batching) while they are
for its adapter and rows are free; the first waiting request that cannot join stops admission, so
the batch drains and that request starts the next one. Tokens travel back to each request's own
asyncio queue as they are sampled. One lock guards the model: adapters load, unload, and the model
sleeps, only between batches; while someone waits for it, nothing joins the running batch. A
request whose ``n`` alone exceeds ``max_batch_size`` runs as a batch of its own.

What a completion holds: every sampled token id, the end-of-sequence token included (the model
produced it and a trainer must score it); per-token logprobs as documented in ``sampling``; text
decoded without special tokens and cut before the first stop string (see ``stops``).

Long module: the scheduler and the model thread share the batch's state (admission, decode steps,
adapter switches, sleep); split, each rule above would be read in two places. Sampling, stops and
LoRA loading are beside it (``sampling``, ``stops``, ``lora``).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import logging
import secrets
import threading
from collections import deque
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from artery.services.inference.engine.base import (
    Completion,
    EngineError,
    GenerationRequest,
    TokenStep,
    UnknownAdapter,
)
from artery.services.inference.engine.decode import DecodeContext, DecodeStats, Row, decode_batch
from artery.services.inference.engine.fp16_weights import use_fp16_weights
from artery.services.inference.engine.lora import LoraSet
from artery.services.inference.engine.sampling import completion_seed
from artery.services.inference.engine.stops import first_stop
from artery.services.inference.settings import DEFAULT_MAX_BATCH_SIZE
from artery.shared.metrics import count_generated
from artery.shared.models import warm_start
from artery.shared.tasks import cancel_and_wait

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Job:
    request: GenerationRequest
    #: Lists of TokenSteps (one list per decode step), or the exception that ended the job.
    queue: asyncio.Queue[list[TokenStep] | BaseException] = field(default_factory=asyncio.Queue)
    open_rows: int = 0
    cancelled: bool = False


class TransformersEngine:
    """``Engine`` on ``transformers`` + ``peft``: CPU or one GPU, in this process."""

    kind = "transformers"

    def __init__(
        self,
        model_path: str | Path,
        *,
        device: str = "cpu",
        dtype: Any = None,
        max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
        max_context: int | None = None,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be at least 1")
        self.model_path = Path(model_path)
        self.device_name = device
        self.dtype = dtype
        self.max_batch_size = max_batch_size
        self.max_context: int = max_context or 0
        self._max_context_arg = max_context
        self.tokenizer: Any = None
        self._thread_tokenizer: Any = None
        #: Forward passes (prefills included), batches and tokens so far: batching shows here.
        self.stats = DecodeStats()
        self._lora: LoraSet | None = None
        self._device: torch.device | None = None
        self._eos_ids: frozenset[int] = frozenset()
        self._pad_id = 0
        self._vocab_size = 0
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="artery-engine")
        self._lock = asyncio.Lock()
        self._awake = asyncio.Event()
        self._awake.set()
        self._sleeping = False
        self._abort = threading.Event()
        self._pending: deque[_Job] = deque()
        #: Guards ``_pending`` and the job list of the running batch: the model thread takes
        #: waiting jobs into the batch between steps while the event loop submits and fails them.
        self._waiting_lock = threading.Lock()
        #: Callers waiting for the model between batches (sleep, wake, adapter changes); while
        #: there are any, the running batch admits nothing and drains.
        self._model_wanted = 0
        self._has_work = asyncio.Event()
        self._scheduler: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # --- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await self._on_model_thread(self._load)
        self._scheduler = asyncio.create_task(self._schedule(), name="artery-engine-scheduler")

    def _load(self) -> None:
        self._device = torch.device(self.device_name)
        dtype = self.dtype
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        if dtype is None:
            on_gpu = self._device.type == "cuda"
            dtype = torch.bfloat16 if on_gpu and torch.cuda.is_bf16_supported() else torch.float32
        # float16 on the CPU: fp16 weights under float32 arithmetic (``fp16_weights``), packed
        # from the float32 model; the CPU has no fast fp16 arithmetic of its own.
        fp16_weights = dtype == torch.float16 and self._device.type == "cpu"
        # A PEFT adapter directory as the model (a warm start): its base, with it as step 0.
        warm = warm_start(self.model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(warm.tokenizer_path() if warm else self.model_path)
        # The model thread decodes (stop strings) while the event loop encodes prompts: a Rust
        # tokenizer shared between threads can fail with "Already borrowed", so each has its own.
        self._thread_tokenizer = copy.deepcopy(self.tokenizer)
        model = AutoModelForCausalLM.from_pretrained(
            warm.base_path() if warm else self.model_path, dtype=torch.float32 if fp16_weights else dtype
        )
        # transformers types ``to`` as functools.wraps(Module.to), which mypy reads unbound.
        model.to(self._device).eval()  # type: ignore[arg-type]
        if fp16_weights:
            use_fp16_weights(model)  # before LoRA: PEFT then wraps the fp16-weight layers
        self._lora = LoraSet(model, warm.adapter_dir if warm else None)
        config = model.config
        self.max_context = self._max_context_arg or int(config.max_position_embeddings)
        self._vocab_size = int(config.vocab_size)
        self._eos_ids = frozenset(_eos_ids(self.tokenizer, model))
        pad = self.tokenizer.pad_token_id
        self._pad_id = pad if pad is not None else min(self._eos_ids)

    async def close(self) -> None:
        self._abort.set()
        if self._scheduler is not None:
            await cancel_and_wait(self._scheduler)
            self._scheduler = None
        with self._waiting_lock:
            waiting, self._pending = list(self._pending), deque()
        _fail(waiting, EngineError("the engine is closing"))
        await asyncio.get_running_loop().run_in_executor(None, self._executor.shutdown)

    async def sleep(self) -> bool:
        """Move the model to the CPU and free GPU memory; False (nothing freed) on the CPU."""
        if self._device is None or self._device.type != "cuda" or self._sleeping:
            return False
        self._awake.clear()
        async with self._between_batches():
            await self._on_model_thread(self._to_cpu)
            self._sleeping = True
        return True

    async def wake(self) -> None:
        async with self._between_batches():
            if self._sleeping:
                lora, device = self._started()
                await self._on_model_thread(lambda: lora.model.to(device))
                self._sleeping = False
        self._awake.set()

    def _started(self) -> tuple[LoraSet, torch.device]:
        """The model (with its adapters) and its device, once ``start`` has loaded them."""
        if self._lora is None or self._device is None:
            raise EngineError("engine not started")
        return self._lora, self._device

    def _to_cpu(self) -> None:
        self._started()[0].model.to("cpu")
        # cuBLAS keeps a workspace per handle in the caching allocator (33 MiB seen on an H100),
        # which empty_cache alone leaves allocated; it is recreated at the next matrix product.
        clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear_workspaces is not None:
            clear_workspaces()
        torch.cuda.empty_cache()

    # --- adapters --------------------------------------------------------------------------------

    async def load_adapter(self, name: str, path: Path) -> None:
        async with self._between_batches():
            await self._on_model_thread(self._started()[0].load, name, Path(path))

    async def unload_adapter(self, name: str) -> None:
        async with self._between_batches():
            await self._on_model_thread(self._started()[0].unload, name)

    async def preload_adapter(self, key: str, path: Path) -> None:
        """Read the adapter in ``path`` under ``key`` without serving it (``PreloadsAdapters``)."""
        lora = self._started()[0]
        async with self._between_batches():
            try:
                await self._on_model_thread(lora.preload, key, Path(path))
            except asyncio.CancelledError:
                # The thread reads on; the drop is queued behind the read on the same thread, so
                # it finds the adapter in (or, the read having failed, nothing to drop).
                with contextlib.suppress(RuntimeError):  # the engine closed meanwhile
                    self._executor.submit(lora.drop_preloaded, key)
                raise

    async def serve_preloaded(self, name: str, key: str) -> None:
        async with self._between_batches():
            await self._on_model_thread(self._started()[0].serve_preloaded, name, key)

    async def drop_preloaded(self, key: str) -> None:
        async with self._between_batches():
            await self._on_model_thread(self._started()[0].drop_preloaded, key)

    @contextlib.asynccontextmanager
    async def _between_batches(self) -> AsyncIterator[None]:
        """The model, once the running batch has ended; it stops admitting rows meanwhile, or
        requests that keep arriving would keep it running for ever."""
        self._model_wanted += 1
        try:
            async with self._lock:
                yield
        finally:
            self._model_wanted -= 1

    def adapters(self) -> list[str]:
        return self._lora.names() if self._lora is not None else []

    # --- generation ------------------------------------------------------------------------------

    async def stream(self, request: GenerationRequest) -> AsyncIterator[TokenStep]:
        job = self._submit(request)
        try:
            while job.open_rows:
                item = await job.queue.get()
                if isinstance(item, BaseException):
                    raise item
                count_generated(len(item))
                for step in item:
                    if step.finish_reason is not None:
                        job.open_rows -= 1
                    yield step
        finally:
            job.cancelled = True  # rows still decoding drop out at their next step

    async def generate(self, request: GenerationRequest) -> list[Completion]:
        n = request.params.n
        tokens: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[float]] = [[] for _ in range(n)]
        tops: list[list[list[tuple[int, float]]]] = [[] for _ in range(n)]
        reasons: list[Any] = ["length"] * n
        async for step in self.stream(request):
            tokens[step.index].append(step.token_id)
            logprobs[step.index].append(step.logprob)
            tops[step.index].append(step.top_logprobs)
            if step.finish_reason is not None:
                reasons[step.index] = step.finish_reason
        completions = []
        for i in range(n):
            text = self.tokenizer.decode(tokens[i], skip_special_tokens=True)
            cut = first_stop(text, request.params.stop)
            if cut is not None:
                text, reasons[i] = text[:cut], "stop"
            completions.append(Completion(i, tokens[i], logprobs[i], tops[i], reasons[i], text))
        return completions

    def _submit(self, request: GenerationRequest) -> _Job:
        if self._abort.is_set():
            raise EngineError("the engine is closed")
        if self._lora is None or self._scheduler is None:
            raise EngineError("the engine is not started")
        params = request.params
        if request.adapter is not None and request.adapter not in self._lora:
            raise UnknownAdapter(f"no adapter {request.adapter!r}; loaded: {self._lora.names()}")
        if not request.prompt_token_ids:
            raise EngineError("the prompt is empty")
        if len(request.prompt_token_ids) >= self.max_context:
            raise EngineError(
                f"the prompt has {len(request.prompt_token_ids)} tokens; the context holds {self.max_context}"
            )
        if params.n < 1 or params.max_tokens < 1:
            raise EngineError("n and max_tokens must be at least 1")
        if params.temperature < 0 or not 0 < params.top_p <= 1 or params.top_logprobs < 0:
            raise EngineError("temperature must be >= 0, top_p in (0, 1], top_logprobs >= 0")
        if any(not 0 <= t < self._vocab_size for t in request.prompt_token_ids):
            raise EngineError("a prompt token id is outside the vocabulary")
        job = _Job(request, open_rows=params.n)
        with self._waiting_lock:
            self._pending.append(job)
        self._has_work.set()
        return job

    # --- scheduling ------------------------------------------------------------------------------

    async def _schedule(self) -> None:
        while True:
            await self._has_work.wait()
            await asyncio.sleep(0)  # requests submitted in the same tick join this batch
            await self._awake.wait()
            async with self._lock:
                if self._sleeping:
                    continue
                batch = self._take_batch()
                if not self._pending:
                    self._has_work.clear()
                if batch:
                    await self._run(batch)

    async def _run(self, batch: list[_Job]) -> None:
        """Decode ``batch``, which grows as requests join it, and fail all of it if that fails."""
        try:
            await self._on_model_thread(self._run_batch, batch)
        except asyncio.CancelledError:
            self._fail_batch(batch, EngineError("the engine is closing"))
            raise
        except EngineError as exc:
            self._fail_batch(batch, exc)
        except Exception as exc:
            log.exception("a batch of %d requests failed", len(batch))
            self._fail_batch(batch, EngineError(f"generation failed: {exc!r}"))

    def _fail_batch(self, batch: list[_Job], error: EngineError) -> None:
        # Cancelled (the engine closing), the model thread may still be admitting jobs into it.
        with self._waiting_lock:
            _fail(batch, error)

    def _take_batch(self) -> list[_Job]:
        """The oldest live request and the next ones for the same adapter that fit beside it."""
        with self._waiting_lock:
            while self._pending and self._pending[0].cancelled:
                self._pending.popleft()
            if not self._pending:
                return []
            adapter = self._pending[0].request.adapter
            batch: list[_Job] = []
            size = 0
            for job in self._pending:
                n = job.request.params.n
                if (
                    job.cancelled
                    or job.request.adapter != adapter
                    or (batch and size + n > self.max_batch_size)
                ):
                    continue
                batch.append(job)
                size += n
            taken = set(map(id, batch))
            self._pending = deque(j for j in self._pending if id(j) not in taken and not j.cancelled)
        return batch

    def _admit(self, adapter: str | None, batch: list[_Job], running: int) -> list[Row]:
        """On the model thread, between steps: the rows of the waiting requests that join ``batch``.

        The oldest waiting requests join while they are for the batch's adapter and fit beside the
        ``running`` rows. The first one that does not stops admission and the batch drains for it,
        so a request for another adapter, or one that needs more rows than are free, is never
        overtaken for ever by requests that keep arriving.
        """
        if self._model_wanted:
            return []
        room = self.max_batch_size - running
        joining: list[_Job] = []
        with self._waiting_lock:
            if self._abort.is_set():  # checked under the lock: close() fails what it finds after
                return []
            while self._pending:
                job = self._pending[0]
                n = job.request.params.n
                if not job.cancelled and (job.request.adapter != adapter or n > room):
                    break
                self._pending.popleft()
                if not job.cancelled:
                    joining.append(job)
                    room -= n
            batch.extend(joining)
        return [row for job in joining for row in self._rows(job)]

    def _rows(self, job: _Job) -> list[Row]:
        """One row per completion of ``job``, each drawing from its own seeded random stream."""
        params = job.request.params
        prompt = job.request.prompt_token_ids
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        budget = min(params.max_tokens, self.max_context - len(prompt))
        cancelled = _flag(job)
        rows = []
        for i in range(params.n):
            generator = torch.Generator().manual_seed(completion_seed(seed, i))
            rows.append(Row(job, i, prompt, params, generator, budget, cancelled=cancelled))
        return rows

    def _run_batch(self, batch: list[_Job]) -> None:
        """On the model thread: decode one batch, sending tokens to each request as they come."""
        adapter = batch[0].request.adapter
        rows = [row for job in batch for row in self._rows(job)]
        lora, device = self._started()
        with torch.inference_mode(), lora.active(adapter) as model:
            ctx = DecodeContext(
                model,
                self._thread_tokenizer,
                device,
                self._eos_ids,
                self._pad_id,
                self._emit,
                self._abort,
                self.stats,
                admit=functools.partial(self._admit, adapter, batch),
            )
            decode_batch(rows, ctx)

    def _emit(self, steps: list[tuple[Any, TokenStep]]) -> None:
        if not steps:
            return
        by_job: dict[_Job, list[TokenStep]] = {}
        for row, step in steps:
            by_job.setdefault(row.owner, []).append(step)
        assert self._loop is not None
        self._loop.call_soon_threadsafe(_deliver, by_job)

    async def _on_model_thread(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)


def _deliver(by_job: dict[_Job, list[TokenStep]]) -> None:
    for job, steps in by_job.items():
        job.queue.put_nowait(steps)


def _fail(batch: list[_Job], error: EngineError) -> None:
    for job in batch:
        job.queue.put_nowait(error)


def _flag(job: _Job):
    return lambda: job.cancelled


def _eos_ids(tokenizer: Any, model: Any) -> set[int]:
    """Every id that ends a completion: the tokenizer's eos, the generation config's, ChatML's."""
    ids: set[int] = set()
    for value in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(value)
    vocab = tokenizer.get_vocab()
    ids.update(vocab[t] for t in ("<|im_end|>", "<|endoftext|>") if t in vocab)
    return ids
