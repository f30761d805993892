"""A single-turn agent: sentiment classification with a programmatic reward, trained with GRPO.

Each step samples ``--groups`` reviews; the agent answers each one ``--group-size`` times through
the model's OpenAI-compatible endpoint (the choices keep their sampled token ids and logprobs);
every answer is scored by a plain Python function, and ``model.train()`` takes one GRPO step on the
LoRA adapter. By default everything runs on the embedded stack (``art.LocalBackend``); with
``--nats-url`` the script joins a deployed Artery (``art.Backend``) instead.

    python examples/single_turn/train.py --steps 20
    python examples/single_turn/train.py --base-model HuggingFaceTB/SmolLM2-135M-Instruct
    python examples/single_turn/train.py --nats-url nats://host:4222 --base-model <the model it serves>
"""

from __future__ import annotations

import argparse
import asyncio
import difflib
import random
import re

import artery as art
from artery.demos.examples_support import TrainingRun, example_parser

LABELS = ("positive", "negative")
SYSTEM = "Classify the sentiment of the review. Answer with one word: positive or negative."
REVIEWS: list[tuple[str, str]] = [
    ("The food was wonderful and the staff were kind.", "positive"),
    ("I loved every minute of this film.", "positive"),
    ("Fast delivery, works exactly as described.", "positive"),
    ("A delightful book that I will read again.", "positive"),
    ("The room was clean, quiet and comfortable.", "positive"),
    ("Great value for the price, highly recommended.", "positive"),
    ("The battery died after two days.", "negative"),
    ("Cold soup, rude waiter, never again.", "negative"),
    ("The plot made no sense and the ending was worse.", "negative"),
    ("It broke the first time I used it.", "negative"),
    ("We waited an hour and the order was still wrong.", "negative"),
    ("Too loud, too dirty and far too expensive.", "negative"),
]


def reward(answer: str, label: str) -> float:
    """1 for the right label as the first word, 0 for the wrong one; anything else earns up to 0.5
    for how close its first word is to the right label (a shaped reward: a random model gets
    different scores within a group, so GRPO has something to compare)."""
    words = re.findall(r"[a-z]+", answer.lower())
    if not words:
        return 0.0
    if words[0] == label:
        return 1.0
    if words[0] in LABELS:
        return 0.0
    return 0.5 * difflib.SequenceMatcher(None, words[0], label).ratio()


async def rollout(
    model: art.TrainableModel, review: str, label: str, *, max_tokens: int, temperature: float
) -> art.Trajectory:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": review}]
    response = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(),
        messages=messages,
        max_tokens=max_tokens,
        temperature=temperature,
        logprobs=True,  # the choice then carries what was sampled: training uses exactly those tokens
    )
    choice = response.choices[0]
    answer = choice.message.content or ""
    score = reward(answer, label)
    return art.Trajectory(
        messages_and_choices=[*messages, choice],
        reward=score,
        metrics={"correct": float(score == 1.0)},
        metadata={"label": label, "answer": answer},
    )


async def run(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    async with TrainingRun(args) as run:
        run.ready(f"inference at {run.model.inference_base_url}")
        for _ in range(args.steps):
            step = await run.model.get_step()
            batch = rng.sample(REVIEWS, k=min(args.groups, len(REVIEWS)))
            groups = await art.gather_trajectory_groups(
                (
                    art.TrajectoryGroup(
                        rollout(
                            run.model, review, label, max_tokens=args.max_tokens, temperature=args.temperature
                        )
                        for _ in range(args.group_size)
                    )
                    for review, label in batch
                ),
                pbar_desc=f"step {step} rollouts",
                max_exceptions=args.group_size * len(batch) // 4,
            )
            await run.train(
                groups,
                reward=lambda t: t.reward,
                accuracy=lambda t: t.metrics["correct"],
                example=next(iter(groups[0])).metadata["answer"],
            )
    return run.summary()


def parser() -> argparse.ArgumentParser:
    return example_parser(
        __doc__,
        model_name="single-turn-001",
        steps=10,
        group_size=8,
        max_tokens=4,
        groups_help="reviews (groups) per step",
        group_size_help="rollouts per review",
    )


def main(argv: list[str] | None = None) -> dict:
    return asyncio.run(run(parser().parse_args(argv)))


if __name__ == "__main__":
    main()
