"""The client side of the serving benchmarks (``inference``, ``serving``): the same prompts, and a
round of chats sent at once to an OpenAI-compatible server, timed."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import httpx

_TOPICS = "apples rivers numbers trains coffee mountains weather books stars tools music maps".split()


@dataclass
class Round:
    seconds: float
    tokens: int
    #: Per-request latencies (HTTP only).
    latencies: list[float] = field(default_factory=list)


def prompts(count: int) -> list[list[dict[str, str]]]:
    """Distinct short chat prompts, the same every run."""
    return [
        [
            {
                "role": "user",
                "content": f"Question {i}: tell me about {_TOPICS[i % len(_TOPICS)]} in {i + 3} words.",
            }
        ]
        for i in range(count)
    ]


async def chat_round(
    client: httpx.AsyncClient, url: str, model: str, batch, max_tokens: int, *, logprobs: bool = False
) -> Round:
    """Every chat of ``batch`` at once, sampled at temperature 1; the time until the last answer
    and the completion tokens."""
    body: dict = {"model": model, "max_tokens": max_tokens, "temperature": 1.0}
    if logprobs:
        body["logprobs"] = True

    async def one(messages) -> tuple[int, float]:
        started = time.perf_counter()
        response = await client.post(f"{url}/v1/chat/completions", json={**body, "messages": messages})
        response.raise_for_status()
        return response.json()["usage"]["completion_tokens"], time.perf_counter() - started

    started = time.perf_counter()
    results = await asyncio.gather(*(one(m) for m in batch))
    return Round(time.perf_counter() - started, sum(r[0] for r in results), [r[1] for r in results])
