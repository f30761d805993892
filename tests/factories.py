"""Builders of realistic wire objects for tests and benchmarks."""

from __future__ import annotations

import random

from artery.schemas import Trajectory
from loadtests.harness import build_group, build_trajectory


def trajectory(reward: float = 0.5, turns: int = 5, seed: int = 0) -> Trajectory:
    """About 2 KB with 10 messages: a system prompt, then user/assistant turns."""
    return build_trajectory(random.Random(seed), reward, turns)


def group(project: str = "demo", model: str = "agent", size: int = 4, seed: int = 0, **kw):
    """Each trajectory drawn from its own seed, so a group's trajectories differ across seeds."""
    return build_group(project, model, size, seed, rng_of=lambda i: random.Random(seed * 1000 + i), **kw)


async def register_trainable(js, project: str, model: str, base_model: str, step: int = 0) -> None:
    """What ``model.register()`` writes for a trainable model: its record in the models bucket."""
    import msgspec

    from artery.schemas import ModelRecord
    from artery.shared import subjects

    record = ModelRecord(project=project, name=model, base_model=base_model, trainable=True, step=step)
    kv = await js.key_value(subjects.MODELS_BUCKET)
    await kv.put(subjects.model_key(project, model), msgspec.json.encode(record))
