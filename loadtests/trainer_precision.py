"""Trainer precision: one GRPO step in float32 against the same step in bf16 autocast, same run.

What runs, in this process, on the CPU: one ``Policy`` (transformers + PEFT, float32 weights,
the trainer's default LoRA) and ``Policy.train_step`` on the demo's shape of step: ``groups`` x
``group_size`` trajectories with a prompt of about ``--prompt-tokens`` tokens and completions of
``--completion-tokens`` sampled tokens, corrected by truncated importance sampling (as
``LocalBackend`` trains a bf16 replica's samples). The steps alternate ``autocast_mode="off"``
and ``"bfloat16"`` after ``--warmup`` steps of each, at a learning rate small enough that the
policy stays the same for both.

Reported: each mode's median step time and trained tokens/s, ``bf16_vs_float32`` (float32's
median step time over bf16's: above 1, autocast is faster), the gap between the two modes'
logprobs of the trained tokens (what truncated importance sampling then corrects), whether the
CPU has bf16 instructions, and which mode the trainer's ``auto`` picks for such a step here.
Without bf16 instructions bf16 is a slow path: the ratio then says by how much.

Results: ``loadtests/results/trainer_precision.json``.
"""

from __future__ import annotations

import random
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from loadtests import harness
from loadtests.harness import argv_of, load_average, machine, report, table
from loadtests.synthetic import synthetic_groups

LEARNING_RATE = 1e-6
TIS_CAP = 2.0
MODES = ("off", "bfloat16")


@dataclass(frozen=True, kw_only=True)
class Config:
    base_model: str
    groups: int
    group_size: int
    prompt_tokens: int
    completion_tokens: int
    steps: int
    warmup: int
    threads: int
    seed: int
    output: Any


def logprob_gap(policy: Any, groups: list[list[Any]], config: Any, max_seq_len: int) -> dict[str, float]:
    """Mean and largest |float32 - bf16 autocast| logprob over the first micro-batch's trained tokens."""
    import torch

    from artery.services.trainer.logprobs import next_token_logprobs
    from artery.services.trainer.precision import autocast
    from artery.services.trainer.sequences import pad_batch

    sequences = policy.prepare_step(groups, config, max_seq_len=max_seq_len).sequences
    batch = pad_batch(sequences[: policy.optim.micro_batch_size], policy.pad_id)
    with torch.no_grad():
        exact = next_token_logprobs(policy.model, batch, 1.0)  # [B,T-1]
        with autocast(policy.device, torch.bfloat16):
            mixed = next_token_logprobs(policy.model, batch, 1.0)  # [B,T-1]
    gap = (exact - mixed).abs()[batch["assistant_mask"].bool()]  # [N]
    return {"mean": round(float(gap.mean()), 5), "max": round(float(gap.max()), 5)}


def demo_shaped_step(config: Config) -> tuple[Any, list[list[Any]]]:
    """A fresh policy of ``config.base_model`` and synthetic groups, each answering one prompt."""
    import torch

    from artery.services.trainer.policy import Policy
    from artery.shared.models import resolve_base_model

    torch.set_num_threads(config.threads)
    policy = Policy.create(resolve_base_model(config.base_model), seed=config.seed)
    groups = synthetic_groups(
        policy.tokenizer,
        random.Random(config.seed),
        groups=config.groups,
        group_size=config.group_size,
        prompt_tokens=config.prompt_tokens,
        completion_tokens=config.completion_tokens,
    )
    return policy, groups


def max_seq_len_of(config: Config) -> int:
    return 2 * (config.prompt_tokens + config.completion_tokens) + 64


def alternate(
    config: Config, modes: Sequence[str], step: Callable[[str], Any]
) -> tuple[dict[str, float], int]:
    """``step(mode)`` for each mode in turn, ``config.warmup`` rounds uncounted and then
    ``config.steps``: each mode's median seconds, and the tokens a step trained."""
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    trained = 0
    for index in range(config.warmup + config.steps):
        line = []
        for mode in modes:
            started = time.perf_counter()
            result = step(mode)
            elapsed = time.perf_counter() - started
            if not result.trained:
                raise RuntimeError(f"the {mode} step trained nothing: {result.skip_reason}")
            trained = int(result.metrics["tokens_trained"])
            if index >= config.warmup:
                times[mode].append(elapsed)
            line.append(f"{mode} {elapsed:.3f} s")
        label = "step" if index >= config.warmup else "warm-up"
        print(f"{label} {index + 1}: {', '.join(line)}", flush=True)
    return {mode: statistics.median(times[mode]) for mode in modes}, trained


def run(config: Config) -> dict[str, Any]:
    import torch

    from artery.schemas import TrainConfig
    from artery.services.trainer.precision import autocast_dtype
    from artery.shared.cpu import cpu_has_bf16

    load_before = load_average()
    policy, groups = demo_shaped_step(config)
    train_config = TrainConfig(learning_rate=LEARNING_RATE, truncated_importance_sampling=TIS_CAP)
    max_seq_len = max_seq_len_of(config)
    medians, trained = alternate(
        config,
        MODES,
        lambda mode: policy.train_step(groups, train_config, max_seq_len=max_seq_len, autocast_mode=mode),
    )
    bf16_cpu = cpu_has_bf16()
    auto = autocast_dtype("auto", policy.device, policy.weights_dtype, corrected=True, bf16_cpu=bf16_cpu)
    return {
        "benchmark": "trainer_precision",
        "config": {k: str(v) for k, v in asdict(config).items()},
        "modes": mode_figures(medians, trained),
        "bf16_vs_float32": round(medians["off"] / medians["bfloat16"], 3),
        "logprob_gap": logprob_gap(policy, groups, train_config, max_seq_len),
        "cpu_has_bf16": bf16_cpu,
        "auto_picks": "bfloat16" if auto is not None else "off",
        "machine": machine(load_before, torch=torch.__version__, device="cpu"),
    }


def mode_figures(medians: dict[str, float], trained: int) -> dict[str, dict[str, Any]]:
    """The ``modes`` of a result: each mode's median step and trained tokens, from ``alternate``."""
    return {
        mode: {
            "median_step_s": round(median, 4),
            "trained_tokens_per_step": trained,
            "trained_tokens_per_s": round(trained / median, 1),
        }
        for mode, median in medians.items()
    }


def mode_table(modes: dict[str, dict[str, Any]], names: dict[str, str]) -> list[str]:
    """Each mode's ``run`` figures as table lines, the mode shown by its name in ``names``."""
    rows: list[tuple[str, ...]] = [("passes", "median step s", "trained tok/step", "trained tok/s")]
    for mode, f in modes.items():
        rows.append(
            (
                names.get(mode, mode),
                f"{f['median_step_s']:.3f}",
                str(f["trained_tokens_per_step"]),
                f"{f['trained_tokens_per_s']:.0f}",
            )
        )
    return table(rows, right={1, 2, 3})


def render(result: dict[str, Any]) -> str:
    lines = mode_table(result["modes"], {"off": "float32", "bfloat16": "bf16 autocast"})
    gap = result["logprob_gap"]
    lines.append(f"bf16 / float32 speed: {result['bf16_vs_float32']}")
    lines.append(f"logprob gap on trained tokens: mean {gap['mean']}, max {gap['max']}")
    lines.append(f"CPU has bf16 instructions: {result['cpu_has_bf16']}; auto picks {result['auto_picks']}")
    return "\n".join(lines)


def parse_args(
    argv: list[str], name: str = "trainer_precision", doc: str | None = __doc__, prompt_tokens: int = 48
) -> Config:
    """The options of a benchmark of one demo-shaped step (this one's, or another's ``name``)."""
    parser = harness.parser(name, doc or "")
    parser.add_argument("--base-model", default="smollm2", help="embedded name or local directory")
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument(
        "--prompt-tokens", type=int, default=prompt_tokens, help="words of each group's prompt"
    )
    parser.add_argument("--completion-tokens", type=int, default=24)
    parser.add_argument("--steps", type=int, default=4, help="measured steps per mode")
    parser.add_argument("--warmup", type=int, default=1, help="steps per mode not counted")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (the demo's trainer: 2)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    sizes = (args.groups, args.prompt_tokens, args.completion_tokens, args.steps, args.threads)
    if min(sizes) < 1 or args.warmup < 0 or args.group_size < 2:
        parser.error("sizes, --steps and --threads must be positive, --group-size at least 2, --warmup >= 0")
    return Config(
        base_model=args.base_model,
        groups=args.groups,
        group_size=args.group_size,
        prompt_tokens=args.prompt_tokens,
        completion_tokens=args.completion_tokens,
        steps=args.steps,
        warmup=args.warmup,
        threads=args.threads,
        seed=args.seed,
        output=args.output,
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    config = parse_args(argv_of(argv))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # autocast's and PEFT's advice
        result = run(config)
    return report(result, render, config.output)


if __name__ == "__main__":
    main()
