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
import statistics
import time

import artery as art

#: The tiny random Qwen2 built locally (no model hub): gibberish answers, but every path runs.
TINY = "artery/tiny-random"
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


def make_backend(args: argparse.Namespace) -> art.Backend:
    if args.nats_url:
        return art.Backend(nats_url=args.nats_url, inference_url=args.inference_url)
    backend = art.LocalBackend(path=args.backend_path, inference_env={"ARTERY_INFERENCE_DEVICE": args.device})
    backend.stack.extra_env["ARTERY_TRAINER_DEVICE"] = args.device
    return backend


async def run(args: argparse.Namespace) -> dict:
    backend = make_backend(args)
    model = art.TrainableModel(
        name=args.model_name, project=args.project, base_model=args.base_model, base_path=args.backend_path
    )
    rng = random.Random(args.seed)
    started = time.monotonic()
    curve: list[dict] = []
    try:
        print(f"registering {args.project}/{args.model_name} ({args.base_model})...", flush=True)
        await model.register(backend)
        if model.inference_base_url is None:
            raise SystemExit(
                f"no inference replica serves {args.project}/{args.model_name}: start one (artery up "
                f"--serve {args.project}/{args.model_name}={args.base_model}) or pass --inference-url"
            )
        print(
            f"ready in {time.monotonic() - started:.1f}s; inference at {model.inference_base_url}", flush=True
        )
        for _ in range(args.steps):
            step = await model.get_step()
            batch = rng.sample(REVIEWS, k=min(args.groups, len(REVIEWS)))
            groups = await art.gather_trajectory_groups(
                (
                    art.TrajectoryGroup(
                        rollout(
                            model, review, label, max_tokens=args.max_tokens, temperature=args.temperature
                        )
                        for _ in range(args.group_size)
                    )
                    for review, label in batch
                ),
                pbar_desc=f"step {step} rollouts",
                max_exceptions=args.group_size * len(batch) // 4,
            )
            trajectories = [t for g in groups for t in g]
            result = await model.train(groups, config=art.TrainConfig(learning_rate=args.learning_rate))
            point = {
                "step": step,
                "new_step": result.step,
                "reward": statistics.fmean(t.reward for t in trajectories),
                "accuracy": statistics.fmean(t.metrics["correct"] for t in trajectories),
                "trajectories": len(trajectories),
                "trained": bool(result.metrics.get("trained", 1.0)),
                "loss": result.metrics.get("loss"),
            }
            curve.append(point)
            print(
                f"step {result.step:>3}: reward {point['reward']:.3f}  accuracy {point['accuracy']:.2f}  "
                + (f"loss {point['loss']:+.4f}" if point["trained"] else "nothing trained (equal rewards)")
                + f"  e.g. {trajectories[0].metadata['answer']!r}",
                flush=True,
            )
        final_step = await model.get_step()
    finally:
        await backend.close()
    summary = {
        "model": f"{args.project}/{args.model_name}",
        "steps": len(curve),
        "final_step": final_step,
        "wall_time_s": round(time.monotonic() - started, 1),
        "curve": curve,
    }
    print(f"done: {len(curve)} steps in {summary['wall_time_s']}s; the model is at step {final_step}")
    return summary


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base-model", default=TINY, help="a local directory or a name the stack resolves")
    p.add_argument("--steps", type=int, default=10, help="training steps in this run")
    p.add_argument("--groups", type=int, default=2, help="reviews (groups) per step")
    p.add_argument("--group-size", type=int, default=8, help="rollouts per review")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--learning-rate", type=float, default=1e-2)
    p.add_argument("--project", default="examples")
    p.add_argument("--model-name", default="single-turn-001", help="a re-run with the same name resumes it")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend-path", default=".artery", help="LocalBackend's directory (stack, history)")
    p.add_argument("--device", default="cpu", help="LocalBackend's trainer and inference device")
    p.add_argument("--nats-url", help="join a deployed Artery (art.Backend) instead of starting one")
    p.add_argument("--inference-url", help="with --nats-url: the OpenAI-compatible base URL (.../v1)")
    return p


def main(argv: list[str] | None = None) -> dict:
    return asyncio.run(run(parser().parse_args(argv)))


if __name__ == "__main__":
    main()
