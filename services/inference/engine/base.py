"""The interface every inference engine implements, and the types that cross it.

The HTTP layer (``api.py``) renders chat messages to token ids with the engine's tokenizer,
asks the engine for completions, and turns them into OpenAI responses; the engine knows nothing
about HTTP or chat formats. Engines: ``transformers`` (in-process, CPU or GPU; the default) and
``vllm`` (GPU and CPU). Everything here is plain Python: no torch, no NATS.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

FinishReason = Literal["stop", "length"]


class EngineError(Exception):
    """An engine could not serve a request (bad adapter, out of memory...)."""


class UnknownAdapter(EngineError):
    pass


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    #: Strings that end a completion; the matched text is not returned (as OpenAI does).
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logprobs: bool = False
    #: How many alternatives to return at each position (0 = none), when ``logprobs``.
    top_logprobs: int = 0


@dataclass(frozen=True)
class GenerationRequest:
    prompt_token_ids: list[int]
    params: SamplingParams
    #: Name of a loaded LoRA adapter (``model@step``), or None for the base model.
    adapter: str | None = None
    request_id: str = ""


@dataclass
class TokenStep:
    """One sampled token of one of the ``n`` completions, as it is produced (for streaming)."""

    index: int  # which of the n completions
    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    #: Set on the last token of that completion.
    finish_reason: FinishReason | None = None


@dataclass
class Completion:
    index: int
    token_ids: list[int]
    #: Logprob of each sampled token under the sampling distribution (temperature applied).
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    finish_reason: FinishReason
    text: str


@runtime_checkable
class Engine(Protocol):
    #: ``transformers`` or ``vllm``.
    kind: str
    #: A Hugging Face tokenizer: ``apply_chat_template``, ``decode``, ``convert_ids_to_tokens``.
    tokenizer: Any
    #: Longest prompt + completion, in tokens.
    max_context: int

    async def start(self) -> None: ...

    def stream(self, request: GenerationRequest) -> AsyncGenerator[TokenStep, None]:
        """Yield tokens of all ``n`` completions as they are sampled, until each one finishes
        (an ``async def`` with ``yield``: calling it starts nothing until it is iterated)."""
        ...

    async def generate(self, request: GenerationRequest) -> list[Completion]:
        """All ``n`` completions, stop strings trimmed."""
        ...

    async def load_adapter(self, name: str, path: Path) -> None:
        """Load a PEFT LoRA adapter (safetensors only) and serve it under ``name``."""
        ...

    async def unload_adapter(self, name: str) -> None: ...

    def adapters(self) -> list[str]: ...

    async def sleep(self) -> bool:
        """Release accelerator memory while paused; True if anything was freed."""
        ...

    async def wake(self) -> None: ...

    async def close(self) -> None: ...


@runtime_checkable
class PreloadsAdapters(Protocol):
    """An engine that can read an adapter ahead of serving it (vLLM: its engine core parses the
    files and builds the LoRA's tensors; transformers: PEFT's layers built or a spare refilled),
    so that serving it once the step is saved is a matter of naming it. The replica preloads a
    step's adapter when the trainer stages it (``checkpoints``)."""

    async def preload_adapter(self, key: str, path: Path) -> None:
        """Read the adapter in ``path`` under ``key``, which serves nothing; ``EngineError`` if it
        cannot be. One cancelled while it is read is forgotten."""
        ...

    async def serve_preloaded(self, name: str, key: str) -> None:
        """Serve the adapter preloaded as ``key`` under ``name``, as ``load_adapter`` would."""
        ...

    async def drop_preloaded(self, key: str) -> None:
        """Forget an adapter preloaded and never served."""
        ...
