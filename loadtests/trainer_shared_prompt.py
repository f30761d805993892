"""Trainer shared prompt: one GRPO step with each group's prompt passed once, against the same step
with every row passed whole, same run.

What runs, in this process, on the CPU: the demo-shaped step of ``trainer_precision`` (one
``Policy`` of ``--base-model``, ``groups`` x ``group_size`` synthetic trajectories, each group
answering one prompt of ``--prompt-tokens`` words with ``--completion-tokens`` sampled tokens,
truncated importance sampling on), in the trainer's default passes (``autocast_mode="auto"``: bf16
autocast on a CPU with bf16 instructions) and in float32. The two ways of passing a micro-batch
alternate in both, after ``--warmup`` steps of each:

- ``whole``: every row through the model from its first token;
- ``shared``: the positions all rows share go through the model once, and the rows continue from
  its KV cache (``services/trainer/logprobs.py``; the trainer's default).

Reported: each mode's median step time and trained tokens/s; ``shared_vs_whole``, whole's median
over shared's in the default passes (above 1, sharing is faster), and ``shared_vs_whole_float32``;
the shared prefix of the first micro-batch; and the largest difference between the two ways'
logprobs of the trained tokens (float rounding only).

Results: ``loadtests/results/trainer_shared_prompt.json``.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from typing import Any

from loadtests.harness import argv_of, load_average, machine, report
from loadtests.trainer_precision import (
    LEARNING_RATE,
    TIS_CAP,
    Config,
    alternate,
    demo_shaped_step,
    max_seq_len_of,
    mode_figures,
    mode_table,
    parse_args,
)

#: Each way of passing the rows, in the trainer's default passes (``auto``: bf16 autocast on a CPU
#: with bf16 instructions) and in float32 (the default elsewhere).
MODES = ("whole", "shared", "whole float32", "shared float32")
NAMES = {"whole": "rows whole", "shared": "prompt shared"}
NAMES |= {f"{mode} float32": f"{name}, float32" for mode, name in NAMES.items()}
#: The demo's prompt is 77 tokens (chat template, instruction, one worked example); 16 synthetic
#: words and SmolLM2's chat template make about as many.
DEMO_PROMPT_WORDS = 16


@contextmanager
def passing(mode: str) -> Iterator[None]:
    """The trainer's passes as ``mode`` says: ``whole`` lifts the shortest prefix worth sharing
    out of reach, so that no micro-batch shares one."""
    from artery.services.trainer import logprobs

    shortest = logprobs.MIN_SHARED_PREFIX
    if mode.startswith("whole"):
        logprobs.MIN_SHARED_PREFIX = 1 << 62
    try:
        yield
    finally:
        logprobs.MIN_SHARED_PREFIX = shortest


def first_micro_batch(policy: Any, groups: list[list[Any]], config: Any, max_seq_len: int) -> dict[str, Any]:
    from artery.services.trainer.sequences import pad_batch

    sequences = policy.prepare_step(groups, config, max_seq_len=max_seq_len).sequences
    return pad_batch(sequences[: policy.optim.micro_batch_size], policy.pad_id)


def logprob_gap(policy: Any, batch: dict[str, Any]) -> float:
    """The largest |whole - shared| logprob over the micro-batch's trained tokens, in float32."""
    import torch

    from artery.services.trainer.logprobs import next_token_logprobs

    with torch.no_grad():
        by_mode = {}
        for mode in MODES:
            with passing(mode):
                by_mode[mode] = next_token_logprobs(policy.model, batch, 1.0)  # [B,T-1]
    gap = (by_mode["whole"] - by_mode["shared"]).abs()[batch["assistant_mask"].bool()]  # [N]
    return round(float(gap.max()), 6)


def run(config: Config) -> dict[str, Any]:
    import torch

    from artery.schemas import TrainConfig
    from artery.services.trainer.logprobs import shared_prefix_length
    from artery.services.trainer.precision import autocast_dtype

    load_before = load_average()
    policy, groups = demo_shaped_step(config)
    train_config = TrainConfig(learning_rate=LEARNING_RATE, truncated_importance_sampling=TIS_CAP)
    max_seq_len = max_seq_len_of(config)

    def step(mode: str) -> Any:
        precision = "off" if mode.endswith("float32") else "auto"
        with passing(mode):
            return policy.train_step(groups, train_config, max_seq_len=max_seq_len, autocast_mode=precision)

    medians, trained = alternate(config, MODES, step)
    batch = first_micro_batch(policy, groups, train_config, max_seq_len)
    return {
        "benchmark": "trainer_shared_prompt",
        "config": {k: str(v) for k, v in asdict(config).items()},
        "modes": mode_figures(medians, trained),
        "shared_vs_whole": round(medians["whole"] / medians["shared"], 3),
        "shared_vs_whole_float32": round(medians["whole float32"] / medians["shared float32"], 3),
        "default_passes_autocast": autocast_dtype("auto", policy.device, policy.weights_dtype, corrected=True)
        is not None,
        "micro_batch": {
            "rows": int(batch["input_ids"].size(0)),
            "length": int(batch["input_ids"].size(1)),
            "shared_prefix": shared_prefix_length(batch),
        },
        "logprob_gap_max": logprob_gap(policy, batch),
        "machine": machine(load_before, torch=torch.__version__, device="cpu"),
    }


def render(result: dict[str, Any]) -> str:
    lines = mode_table(result["modes"], NAMES)
    micro = result["micro_batch"]
    default = "bf16 autocast" if result["default_passes_autocast"] else "float32"
    lines.append(f"shared / whole speed: {result['shared_vs_whole']} (default passes: {default})")
    lines.append(f"shared / whole speed in float32: {result['shared_vs_whole_float32']}")
    shape = f"{micro['rows']} rows of {micro['length']} positions"
    lines.append(f"first micro-batch: {shape}, the first {micro['shared_prefix']} shared")
    lines.append(f"largest logprob difference on trained tokens: {result['logprob_gap_max']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    config = parse_args(argv_of(argv), "trainer_shared_prompt", __doc__, prompt_tokens=DEMO_PROMPT_WORDS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # autocast's and PEFT's advice
        result = run(config)
    return report(result, render, config.output)


if __name__ == "__main__":
    main()
