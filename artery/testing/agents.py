"""A ready-made agent for the toy task: used by ``make demo``, the loop benchmark and the tests."""

from __future__ import annotations

import artery as art
from artery.testing.tasks import half_alphabet_reward, half_alphabet_task_prompt


async def half_alphabet_rollout(
    model: art.TrainableModel, *, max_tokens: int = 8, temperature: float = 1.0
) -> art.Trajectory:
    """One rollout through the model's OpenAI endpoint; the choice keeps its sampled tokens."""
    messages = half_alphabet_task_prompt()
    response = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(),
        messages=messages,
        max_tokens=max_tokens,
        temperature=temperature,
        logprobs=True,
    )
    choice = response.choices[0]
    text = choice.message.content or ""
    return art.Trajectory(
        messages_and_choices=[*messages, choice], reward=half_alphabet_reward(text), metadata={"answer": text}
    )
