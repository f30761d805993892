"""Ready-made agents for the toy tasks: used by ``make demo``, the loop benchmark and the tests.

Each rollout goes through the model's OpenAI endpoint; the choice keeps its sampled tokens (token
ids and logprobs), so the trainer trains on exactly what was sampled. ``temperature=0`` asks for
the greedy answer (for evaluation), ``seed`` for a reproducible sample; ``inference_name`` picks a
step (``model@0`` is the base model), by default the latest.
"""

from __future__ import annotations

from typing import Any

import artery as art
from artery.testing.tasks import (
    half_alphabet_reward,
    half_alphabet_task_prompt,
    lowercase_reward,
    lowercase_reward_parts,
    lowercase_task_prompt,
)


async def _complete(
    model: art.TrainableModel,
    messages: list[dict[str, str]],
    *,
    max_tokens: int,
    temperature: float,
    seed: int | None,
    inference_name: str | None,
) -> Any:
    extra: dict[str, Any] = {} if seed is None else {"seed": seed}
    response = await model.openai_client().chat.completions.create(
        model=inference_name or model.get_inference_name(),
        messages=messages,
        max_tokens=max_tokens,
        temperature=temperature,
        logprobs=True,
        **extra,
    )
    return response.choices[0]


async def half_alphabet_rollout(
    model: art.TrainableModel,
    *,
    max_tokens: int = 8,
    temperature: float = 1.0,
    seed: int | None = None,
    inference_name: str | None = None,
) -> art.Trajectory:
    """One rollout of the half-alphabet task (``artery.testing.tasks``)."""
    messages = half_alphabet_task_prompt()
    choice = await _complete(
        model,
        messages,
        max_tokens=max_tokens,
        temperature=temperature,
        seed=seed,
        inference_name=inference_name,
    )
    text = choice.message.content or ""
    return art.Trajectory(
        messages_and_choices=[*messages, choice], reward=half_alphabet_reward(text), metadata={"answer": text}
    )


async def lowercase_rollout(
    model: art.TrainableModel,
    subject: str,
    *,
    max_tokens: int = 20,
    temperature: float = 1.0,
    seed: int | None = None,
    inference_name: str | None = None,
) -> art.Trajectory:
    """One rollout of the lowercase-sentence task about ``subject``; the reward's checks
    (``valid``, ``lowercase``, ``one_sentence``) are kept as metrics."""
    messages = lowercase_task_prompt(subject)
    choice = await _complete(
        model,
        messages,
        max_tokens=max_tokens,
        temperature=temperature,
        seed=seed,
        inference_name=inference_name,
    )
    text = choice.message.content or ""
    return art.Trajectory(
        messages_and_choices=[*messages, choice],
        reward=lowercase_reward(text, subject),
        metrics=lowercase_reward_parts(text, subject),
        metadata={"answer": text, "subject": subject},
    )
