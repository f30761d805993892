"""Builders of realistic wire objects for tests and benchmarks."""

from __future__ import annotations

import random

from artery.schemas import Message, Sample, Trajectory, TrajectoryGroupSubmitted, new_event_id


def trajectory(reward: float = 0.5, turns: int = 5, seed: int = 0) -> Trajectory:
    """About 2 KB with 10 messages: a system prompt, then user/assistant turns."""
    rng = random.Random(seed)
    messages = [Message(role="system", content="You are a careful assistant. " * 4)]
    for turn in range(turns):
        messages.append(Message(role="user", content=f"Question {turn}: what is {rng.randint(1, 99)} + 7?"))
        ids = [rng.randrange(1000) for _ in range(12)]
        messages.append(
            Message(
                role="assistant",
                content=f"<answer>{rng.randint(1, 120)}</answer>",
                sample=Sample(token_ids=ids, logprobs=[-rng.random() for _ in ids], finish_reason="stop"),
            )
        )
    return Trajectory(messages=messages[: 2 * turns], reward=reward, metrics={"turns": turns})


def group(project: str = "demo", model: str = "agent", size: int = 4, seed: int = 0, **kw):
    return TrajectoryGroupSubmitted(
        id=new_event_id(),
        project=project,
        model=model,
        trajectories=[trajectory(reward=i / size, seed=seed * 1000 + i) for i in range(size)],
        **kw,
    )


async def register_trainable(js, project: str, model: str, base_model: str, step: int = 0) -> None:
    """What ``model.register()`` writes for a trainable model: its record in the models bucket."""
    import msgspec

    from artery.schemas import ModelRecord
    from artery.shared import subjects

    record = ModelRecord(project=project, name=model, base_model=base_model, trainable=True, step=step)
    kv = await js.key_value(subjects.MODELS_BUCKET)
    await kv.put(subjects.model_key(project, model), msgspec.json.encode(record))
