"""Made-up trajectories for the trainer benchmarks: what a step trains on, without a sampler."""

from __future__ import annotations

import random
from typing import Any


def synthetic_groups(
    tokenizer: Any,
    rng: random.Random,
    *,
    groups: int,
    group_size: int,
    prompt_tokens: int,
    completion_tokens: int,
) -> list[list[Any]]:
    """Trajectories as the inference service records them: sampled ids and their logprobs, and
    rewards spread within each group (every advantage non-zero)."""
    from artery.schemas import Message, Sample, Trajectory

    words = [w for w in tokenizer.get_vocab() if w.isalpha()] or ["a"]
    special = set(tokenizer.all_special_ids)
    ordinary = [i for i in range(len(tokenizer)) if i not in special]
    made = []
    for _ in range(groups):
        text = " ".join(rng.choice(words) for _ in range(prompt_tokens))
        prompt = [Message(role="user", content=text)]
        group = []
        for j in range(group_size):
            ids = [rng.choice(ordinary) for _ in range(completion_tokens)]
            sample = Sample(
                token_ids=ids, logprobs=[-rng.uniform(0.5, 3.0) for _ in ids], finish_reason="length"
            )
            answer = Message(role="assistant", content=tokenizer.decode(ids), sample=sample)
            group.append(Trajectory(messages=[*prompt, answer], reward=j / (group_size - 1)))
        made.append(group)
    return made
