"""What many test modules share: waiting on a condition, loading a script, and one fake inference engine.

The fake engine stands in for vLLM / transformers wherever a test needs the engine's contract and
not its model: a character-level tokenizer and a fixed reply make every token checkable, and the
same object records the pause calls (``sleep``/``wake``) and adapter loads a replica makes.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from artery.schemas import CheckpointSaved, new_event_id
from artery.services.inference.engine.base import (
    Completion,
    EngineError,
    FinishReason,
    GenerationRequest,
    TokenStep,
)


async def wait_for(
    predicate: Callable[[], Awaitable[Any]],
    timeout: float = 15.0,
    interval: float = 0.05,
    why: Callable[[], str] = lambda: "",
) -> Any:
    """Poll the async ``predicate`` until it returns something truthy, and return that.

    ``why`` adds context to the failure message (read only when the wait fails).
    """
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        value = await predicate()
        if value:
            return value
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"condition not met in {timeout}s (last value {value!r}){why()}")
        await asyncio.sleep(interval)


async def wait_until(predicate: Callable[[], object], timeout: float = 10.0) -> None:
    """Poll the plain (not async) ``predicate`` until it holds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def load_script(path: Path, name: str) -> ModuleType:
    """A Python file that is not in a package (a Makefile's helper, an example's script) as a module."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, f"{path} is not a Python file"
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------- the fake engine


EOS = 1
REPLY = "Hello, world! I am fake."
TOOL_REPLY = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


class CharTokenizer:
    """One token per character (id = code point + 2); ``<|im_end|>`` (id 1) is special."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) + 2 for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(("" if skip_special_tokens else "<|im_end|>") if i == EOS else chr(i - 2) for i in ids)

    def convert_ids_to_tokens(self, ids):
        if isinstance(ids, int):
            return self.decode([ids])
        return [self.decode([i]) for i in ids]

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=False, tokenize=True, **_):
        self.last_messages = messages
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        if tools:
            text = f"<tools>{json.dumps(tools)}\n" + text
        if add_generation_prompt:
            text += "<assistant>"
        return {"input_ids": self.encode(text)}  # as transformers 5 does: a BatchEncoding


class FakeEngine:
    """Answers ``REPLY`` (``TOOL_REPLY`` when asked about the weather), tagged with the adapter.

    It also records what a replica asks of its engine: ``calls`` the pause gate's ``sleep``/``wake``,
    ``loads`` every adapter loaded with the tensors read from its file, ``unloads`` every unload;
    ``loaded`` is what it serves now (a test may set it directly).
    """

    kind = "fake"

    def __init__(self, max_context: int = 400) -> None:
        self.tokenizer = CharTokenizer()
        self.max_context = max_context
        self.loaded: list[str] = []
        self.requests: list[GenerationRequest] = []
        #: Seconds between streamed tokens.
        self.delay = 0.0
        self.calls: list[str] = []
        self.loads: list[tuple[str, dict[str, Any]]] = []
        self.unloads: list[str] = []

    def adapters(self) -> list[str]:
        return list(self.loaded)

    async def sleep(self) -> bool:
        self.calls.append("sleep")
        return True

    async def wake(self) -> None:
        self.calls.append("wake")

    async def load_adapter(self, name: str, path: Path) -> None:
        # What a real engine would read: the safetensors file, copied out of the cache dir.
        # Imported here so that the tests which never load an adapter never import torch.
        from safetensors.torch import load_file

        self.loads.append((name, load_file(str(path / "adapter_model.safetensors"))))
        self.loaded.append(name)

    async def unload_adapter(self, name: str) -> None:
        self.unloads.append(name)
        self.loaded.remove(name)

    def _tokens(self, request: GenerationRequest) -> tuple[list[int], str, FinishReason]:
        prompt = self.tokenizer.decode(request.prompt_token_ids)
        if "explode" in prompt:
            raise EngineError("out of fake memory")
        reply = TOOL_REPLY if "weather" in prompt else REPLY
        if request.adapter:
            reply += f" [{request.adapter}]"
        params = request.params
        reason: FinishReason = "stop"
        cut = min((i for s in params.stop if (i := reply.find(s)) >= 0), default=None)
        if cut is not None:  # keep the tokens up to the end of the stop string, trim the text
            stop = next(s for s in params.stop if reply.find(s) == cut)
            ids, text = self.tokenizer.encode(reply[: cut + len(stop)]), reply[:cut]
        else:
            ids, text = [*self.tokenizer.encode(reply), EOS], reply
        if len(ids) > params.max_tokens:
            ids, reason = ids[: params.max_tokens], "length"
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return ids, text, reason

    @staticmethod
    def _logprob(position: int) -> float:
        return -0.05 - 0.1 * (position % 5)

    def _top(self, token_id: int, position: int, k: int) -> list[tuple[int, float]]:
        return [(token_id + j, self._logprob(position) - j) for j in range(k)]

    async def generate(self, request: GenerationRequest) -> list[Completion]:
        self.requests.append(request)
        ids, text, reason = self._tokens(request)
        k = request.params.top_logprobs
        return [
            Completion(
                index=index,
                token_ids=list(ids),
                logprobs=[self._logprob(p) for p in range(len(ids))],
                top_logprobs=[self._top(t, p, k) for p, t in enumerate(ids)],
                finish_reason=reason,
                text=text,
            )
            for index in range(request.params.n)
        ]

    async def stream(self, request: GenerationRequest) -> AsyncIterator[TokenStep]:
        self.requests.append(request)
        ids, _, reason = self._tokens(request)
        k = request.params.top_logprobs
        for p, token_id in enumerate(ids):
            for index in range(request.params.n):  # the n completions interleave, as a batch does
                last = p == len(ids) - 1
                yield TokenStep(
                    index, token_id, self._logprob(p), self._top(token_id, p, k), reason if last else None
                )
            await asyncio.sleep(self.delay)


def saved(model: str = "agent", *, uri: str = "file:///ok") -> CheckpointSaved:
    """A ``checkpoint.saved`` of project ``proj``: the event the subscriber tests deliver."""
    return CheckpointSaved(
        id=new_event_id(),
        project="proj",
        model=model,
        step=1,
        uri=uri,
        sha256="0" * 64,
        size_bytes=1,
        base_model="base",
    )
