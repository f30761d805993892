"""``make demo``: the data path end to end on the embedded stack (no Docker, GPU or network).

An arithmetic agent answers questions in groups of rollouts; each group is published with one
call, the collector stores it in PostgreSQL and announces it, and the demo reports what arrived.
The policy here is a scripted stand-in whose accuracy you can set; the model-backed agent,
training and the reward curve arrive with the inference, trainer and RULER services.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

import asyncpg

import artery as art


async def rollout(model: art.Model, question: tuple[int, int], rng: random.Random, accuracy: float):
    a, b = question
    trajectory = art.Trajectory(
        messages_and_choices=[
            {"role": "system", "content": "Answer with <answer>N</answer>."},
            {"role": "user", "content": f"What is {a} + {b}?"},
        ],
        metadata={"question": f"{a}+{b}"},
    )
    async with trajectory.track_duration("policy"):
        await asyncio.sleep(rng.random() * 0.01)
        answer = a + b if rng.random() < accuracy else a + b + rng.randint(1, 9)
    trajectory.messages_and_choices.append({"role": "assistant", "content": f"<answer>{answer}</answer>"})
    trajectory.reward = 1.0 if answer == a + b else 0.0
    trajectory.metrics["correct"] = answer == a + b
    return trajectory.finish()


async def run(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    backend = art.LocalBackend(path=args.home)
    model = art.TrainableModel(name="adder", project="demo", base_model="scripted")
    started = time.monotonic()
    await model.register(backend)
    print(f"embedded stack up in {time.monotonic() - started:.1f}s (state in {args.home})")
    try:
        questions = [(rng.randint(1, 50), rng.randint(1, 50)) for _ in range(args.groups)]
        groups = await art.gather_trajectory_groups(
            (
                art.TrajectoryGroup(rollout(model, q, rng, args.accuracy) for _ in range(args.group_size))
                for q in questions
            ),
            pbar_desc="rollouts",
        )
        ids = await model.publish(groups)
        metrics = await model.log(groups[: max(1, len(groups) // 10)], split="val")
        conn = await asyncpg.connect(backend.database_url)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            stored = await conn.fetchval("SELECT count(*) FROM trajectory_groups WHERE id = ANY($1)", ids)
            if stored == len(ids):
                break
            await asyncio.sleep(0.1)
        rows = await conn.fetchval("SELECT count(*) FROM trajectories")
        mean = await conn.fetchval("SELECT avg(reward) FROM trajectories")
        await conn.close()
        summary = {
            "groups_published": len(ids),
            "groups_stored": stored,
            "trajectories_stored": rows,
            "mean_reward_stored": round(mean or 0.0, 4),
            "val_metrics": metrics,
            "step": await model.get_step(),
        }
        print(json.dumps(summary, indent=2))
        if stored != len(ids):
            raise SystemExit(f"only {stored} of {len(ids)} groups were stored")
        return summary
    finally:
        await backend.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--home", default=".artery/demo")
    parser.add_argument("--groups", type=int, default=200)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--accuracy", type=float, default=0.6)
    parser.add_argument("--seed", type=int, default=0)
    asyncio.run(run(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
