"""``make demo-agent``: the training run, its summary and plot.

Each step samples ``--groups`` questions × ``--group-size`` episodes through the OpenAI-compatible
endpoint (multi-turn, tools), scores them with the programmatic reward (or a RULER judge with
``--judge-model``), and calls ``model.train()``; held-out questions are evaluated before and
after. The summary (``summary.json``) has the shape of ``make demo``'s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

import artery as art
from artery.demos.demo import _prepare_model, plot
from artery.demos.demo_agent import agent
from artery.demos.demo_agent.evaluate import evaluate, figures
from artery.demos.demo_agent.task import Question, questions

#: Seeds of the question sets: the held-out questions never appear in training (checked).
TRAIN_SEED, HELD_OUT_SEED = 1, 2

RUBRIC = """
- The goal is the correct final number, reported after calling the calculator tool.
- A trajectory with the correct final number obtained from a valid tool call must score higher than one without.
- A well-formed calculator call with the right expression is better than a malformed or wrong one.
- Guessing without the tool, listing several numbers, empty or rambling answers score lowest.
"""  # noqa: E501


def judge_params(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    """The RULER judge's litellm model name and extra parameters (``--judge-*``)."""
    extra: dict[str, Any] = {}
    if args.judge_api_base:
        extra["api_base"] = args.judge_api_base
    key = args.judge_api_key or os.environ.get("ARTERY_JUDGE_API_KEY")
    if args.judge_api_base or key:
        extra["api_key"] = key or "none"
    return args.judge_model, extra


def question_sets(args: argparse.Namespace) -> tuple[list[Question], list[Question]]:
    held_out = questions(args.kinds, args.eval_questions, HELD_OUT_SEED)
    texts = {q.text for q in held_out}
    train = [q for q in questions(args.kinds, 300, TRAIN_SEED) if q.text not in texts]
    return train, held_out


async def run(args: argparse.Namespace) -> dict:
    _prepare_model(args.base_model)
    run_dir = Path(args.home)
    run_dir.mkdir(parents=True, exist_ok=True)
    # No --engine: LocalBackend picks the fastest engine that serves the model here (and says so).
    backend = art.LocalBackend(
        path=run_dir,
        inference_env={
            "ARTERY_INFERENCE_DEVICE": args.device,
            "ARTERY_INFERENCE_TORCH_THREADS": str(args.torch_threads),
        },
        engine=args.engine,
    )
    backend.stack.extra_env["ARTERY_TRAINER_DEVICE"] = args.device
    backend.stack.extra_env["ARTERY_TRAINER_TORCH_THREADS"] = str(args.torch_threads)
    model = art.TrainableModel(
        name=f"agent-{time.strftime('%Y%m%d-%H%M%S')}", project="demo-agent", base_model=args.base_model
    )
    train_items, held_out_items = question_sets(args)
    started = time.monotonic()
    print(
        f"task: calculator tool, questions of kind {', '.join(args.kinds)}; model: {args.base_model}\n"
        "starting the embedded stack (NATS, PostgreSQL, collector, trainer, publisher, inference)..."
    )

    async def episode(q: Question, temperature: float, seed: int | None, name: str | None) -> art.Trajectory:
        return await agent.rollout(
            model,
            q,
            max_tokens=args.max_tokens,
            max_turns=args.max_turns,
            temperature=temperature,
            seed=seed,
            inference_name=name,
        )

    judge_failures = 0

    async def score(group: art.TrajectoryGroup) -> art.TrajectoryGroup:
        nonlocal judge_failures
        if not args.judge_model:
            return group
        name, extra = judge_params(args)
        try:
            scored = await art.rewards.ruler_score_group(
                group, name, extra_litellm_params=extra, rubric=RUBRIC
            )
        except Exception as exc:  # the judge's answer unusable twice, or the call failed
            judge_failures += 1
            tqdm.write(f"the judge could not score a group (its own rewards kept): {str(exc)[:200]!r}")
            return group
        return group if scored is None else scored  # None only when asked to swallow exceptions

    curve: list[dict] = []
    held_out: list[dict] = []
    cursor = 0
    try:
        # Inside the try: a start that fails half-way (a replica that never gets ready, Ctrl-C)
        # still stops what it started.
        await model.register(backend)
        print(f"up in {time.monotonic() - started:.1f}s; serving {model.name} at {model.inference_base_url}")
        held_out.append(
            await evaluate(episode, held_out_items, args.eval_samples, f"{model.name}@0", 0, args.temperature)
        )
        steps_bar = tqdm(total=args.steps, desc="training steps", unit="step")
        try:
            for _ in range(args.steps):
                step = await model.get_step()
                items = [train_items[(cursor + i) % len(train_items)] for i in range(args.groups)]
                cursor += args.groups
                groups = await art.gather_trajectory_groups(
                    (
                        art.trajectory_group(
                            episode(q, args.temperature, None, None) for _ in range(args.group_size)
                        )
                        for q in items
                    ),
                    pbar_desc=f"step {step:>3} rollouts",
                    after_each=score,
                )
                trajectories = [t for g in groups for t in g]
                f = figures(trajectories)
                result = await model.train(groups, config=art.TrainConfig(learning_rate=args.learning_rate))
                m = result.metrics
                point = {
                    "step": step,
                    "reward_mean": statistics.fmean(t.reward for t in trajectories),
                    "success": f["success"],
                    "valid_call": f["valid_call"],
                    "turns": f["turns"],
                    "loss": m.get("loss"),
                }
                curve.append(point)
                trained = (
                    f"loss {m['loss']:+.4f}"
                    if m.get("trained", 1.0) and "loss" in m
                    else "nothing to train: every group's rewards were equal"
                )
                steps_bar.update(1)
                steps_bar.write(
                    f"step {step:>3}: reward {point['reward_mean']:.3f}  success {f['success']:.2f}  "
                    f"valid call {f['valid_call']:.2f}  turns {f['turns']:.2f}  {trained}"
                    f" -> policy {result.step}"
                )
        finally:
            steps_bar.close()
        final = await model.get_step()
        held_out.append(
            await evaluate(
                episode,
                held_out_items,
                args.eval_samples,
                model.get_inference_name(final),
                final,
                args.temperature,
            )
        )
    finally:
        await backend.close()
    before, after = held_out
    engine = backend.engines.get((model.project, model.name))
    summary = summarize(args, model.name, curve, before, after, time.monotonic() - started, judge_failures)
    summary["settings"] |= {
        "engine": engine.engine if engine else args.engine,
        "dtype": engine.dtype if engine else None,
        "truncated_importance_sampling": engine.tis_cap if engine else None,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    plotted = plot(curve, [before, after], run_dir / "reward_curve.png", "calculator tool, multi-turn")
    report(summary, run_dir, plotted)
    return summary


def summarize(
    args: argparse.Namespace,
    name: str,
    curve: list[dict],
    before: dict,
    after: dict,
    wall_s: float,
    judge_failures: int,
) -> dict:
    first, last = curve[: min(3, len(curve))], curve[-min(3, len(curve)) :]
    return {
        "model": name,
        "base_model": args.base_model,
        "task": "calculator_tool",
        "kinds": list(args.kinds),
        "steps": len(curve),
        "mode": "sync",
        "reward": f"ruler:{args.judge_model}" if args.judge_model else "programmatic",
        "judge_failures": judge_failures,
        "settings": {
            "groups": args.groups,
            "group_size": args.group_size,
            "max_tokens": args.max_tokens,
            "max_turns": args.max_turns,
            "temperature": args.temperature,
            "learning_rate": args.learning_rate,
            "eval_questions": args.eval_questions,
            "eval_samples": args.eval_samples,
            "device": args.device,
            "torch_threads": args.torch_threads,
        },
        # Held-out questions, sampled with the same seeds before and after training (mean reward).
        "reward_start": before["sampled"],
        "reward_end": after["sampled"],
        "improved": after["sampled"] > before["sampled"],
        "success_gain": after["sampled_success"] - before["sampled_success"],
        "held_out": {"before": before, "after": after},
        "train_reward_first_steps": statistics.fmean(p["reward_mean"] for p in first) if first else None,
        "train_reward_last_steps": statistics.fmean(p["reward_mean"] for p in last) if last else None,
        "wall_time_s": round(wall_s, 1),
        "curve": curve,
    }


def report(summary: dict, run_dir: Path, plotted: bool) -> None:
    b, a = summary["held_out"]["before"], summary["held_out"]["after"]
    rows = "".join(
        f"\n  {label:<22} {b[key]:.2f} -> {a[key]:.2f}"
        for label, key in (
            ("sampled mean reward", "sampled"),
            ("sampled success", "sampled_success"),
            ("greedy mean reward", "greedy"),
            ("greedy success", "greedy_success"),
            ("valid call (sampled)", "sampled_valid_call"),
            ("tool-call validity", "sampled_tool_call_validity"),
            ("turns per episode", "sampled_turns"),
        )
    )
    print(
        f"\n{summary['steps']} steps in {summary['wall_time_s']}s."
        f" Held-out questions, before -> after:{rows}\n"
        f"greedy answers after: {[(x['question'], x['final']) for x in a['answers'][:3]]}\n"
        f"summary: {run_dir / 'summary.json'}"
        + (f"\nreward curve: {run_dir / 'reward_curve.png'}" if plotted else "")
    )
