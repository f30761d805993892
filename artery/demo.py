"""``make demo``: an agent learns, through every Artery service, on the embedded stack.

No Docker, GPU or network: NATS and PostgreSQL come from wheels, the model is the tiny random
Qwen2 built locally (``artery/tiny-random``). Each iteration the agent samples groups of
rollouts through the OpenAI-compatible inference service, scores them, and calls
``model.train()``: the collector stores the groups, the trainer pauses inference and takes a
GRPO step on the LoRA adapter, the publisher ships the adapter, and inference serves it. The task
(``artery.testing.tasks.half_alphabet``) rewards answers made of the letters a-m: a random model
scores about 0.4, and an empty answer scores 0. At the end: a summary (also ``summary.json``) and
the reward curve (``reward_curve.png``) in the run directory.

Options: ``--base-model`` (a local model directory), ``--steps``, ``--learning-rate``; with a GPU,
``--device cuda`` (trainer and transformers engine) or ``--engine vllm`` (the ``gpu`` extra).
The SmolLM2 demo with RULER scoring comes with the reward service.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import artery as art
from artery.shared.models import TINY
from artery.testing.agents import half_alphabet_rollout


def plot(curve: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the plot extra is optional; summary.json has the same numbers
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([p["step"] for p in curve], [p["reward_mean"] for p in curve], marker="o", label="mean reward")
    ax.set_xlabel("training step (policy version)")
    ax.set_ylabel("mean reward of the step's rollouts")
    ax.set_ylim(0, 1.05)
    ax.set_title("Artery demo: half-alphabet task")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


async def run(args: argparse.Namespace) -> dict:
    run_dir = Path(args.home)
    run_dir.mkdir(parents=True, exist_ok=True)
    inference_env = {"ARTERY_INFERENCE_DEVICE": args.device, "ARTERY_INFERENCE_ENGINE": args.engine}
    backend = art.LocalBackend(path=run_dir, inference_env=inference_env)
    backend.stack.extra_env["ARTERY_TRAINER_DEVICE"] = args.device
    model = art.TrainableModel(
        name=f"agent-{time.strftime('%Y%m%d-%H%M%S')}", project="demo", base_model=args.base_model
    )
    started = time.monotonic()
    print("starting the embedded stack (NATS, PostgreSQL, collector, trainer, publisher, inference)...")
    await model.register(backend)
    print(f"up in {time.monotonic() - started:.1f}s; serving {model.name} at {model.inference_base_url}")
    curve: list[dict] = []

    def rollout():
        return half_alphabet_rollout(model, max_tokens=args.max_tokens)

    try:
        for _ in range(args.steps):
            step = await model.get_step()
            groups = await art.gather_trajectory_groups(
                (art.TrajectoryGroup(rollout() for _ in range(args.group_size)) for _ in range(args.groups)),
                pbar_desc=f"step {step:>3} rollouts",
            )
            reward = statistics.fmean(t.reward for g in groups for t in g)
            result = await model.train(groups, config=art.TrainConfig(learning_rate=args.learning_rate))
            curve.append({"step": step, "reward_mean": reward, "loss": result.metrics.get("loss")})
            m = result.metrics
            trained = (
                f"loss {m['loss']:+.4f}, {m.get('tokens_trained', 0):.0f} tokens trained"
                if m.get("trained", 1.0) and "loss" in m
                else "nothing to train: every group's rewards were equal"
            )
            print(
                f"step {result.step:>3}: reward {reward:.3f}  {trained}"
                f"  ({m.get('step_total_s', 0):.2f}s in the trainer)",
                flush=True,
            )
        final = await art.gather_trajectory_groups(
            [art.TrajectoryGroup(rollout() for _ in range(args.group_size * args.groups))],
            pbar_desc="final rollouts",
        )
        end_reward = statistics.fmean(t.reward for t in final[0])
        curve.append({"step": await model.get_step(), "reward_mean": end_reward, "loss": None})
        examples = [t.metadata["answer"] for t in final[0].trajectories[:5]]
    finally:
        await backend.close()
    first = curve[: min(3, len(curve))]
    summary = {
        "model": model.name,
        "base_model": args.base_model,
        "steps": len(curve) - 1,
        "reward_start": statistics.fmean(p["reward_mean"] for p in first),
        "reward_end": end_reward,
        "improved": end_reward > statistics.fmean(p["reward_mean"] for p in first),
        "wall_time_s": round(time.monotonic() - started, 1),
        "answers_at_the_end": examples,
        "curve": curve,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    plotted = plot(curve, run_dir / "reward_curve.png")
    print(
        f"\nsteps {summary['steps']}: mean reward {summary['reward_start']:.3f} at the start, "
        f"{summary['reward_end']:.3f} at the end ({summary['wall_time_s']}s)\n"
        f"answers now: {examples}\n"
        f"summary: {run_dir / 'summary.json'}"
        + (f"\nreward curve: {run_dir / 'reward_curve.png'}" if plotted else "")
    )
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--home", default=".artery/demo", help="run directory (stack state, summary, plot)")
    parser.add_argument("--base-model", default=TINY)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--groups", type=int, default=2, help="groups (prompts) per step")
    parser.add_argument("--group-size", type=int, default=8, help="rollouts per group")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--learning-rate", type=float, default=1e-2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--engine", default="transformers", choices=["transformers", "vllm"])
    summary = asyncio.run(run(parser.parse_args(argv)))
    if not summary["improved"]:
        raise SystemExit("the mean reward did not rise")


if __name__ == "__main__":
    main()
