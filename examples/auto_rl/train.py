"""AutoRL: train a model on a task you only describe: generated inputs, RULER, GRPO (``artery.auto``).

An LLM writes ``--num-inputs`` inputs for the task (and a system prompt); each is rolled out
``--group-size`` times; RULER compares the rollouts of each input (in this process, or by the
reward service with ``--ruler service``) and ``model.train`` takes a step per batch. The inputs are
stored as ``auto_rl_inputs.json`` in the model's directory: a re-run with the same task replays
them (``--regenerate`` asks the generator again).

Generator and judge: any litellm model (``openai/gpt-4.1-mini`` with ``OPENAI_API_KEY``...), any
OpenAI-compatible server (``--generator-api-base`` / ``--judge-api-base`` with ``openai/<name>``),
or ``self``: Artery's own endpoint serving the model being trained (a real base model is needed
for it to write usable JSON; the tiny test model cannot).

    python examples/auto_rl/train.py --task "Fix the grammar of the user's text." \\
        --generator-model openai/gpt-4.1-mini --judge-model openai/o4-mini
    python examples/auto_rl/train.py --base-model Qwen/Qwen2.5-1.5B-Instruct --generator-model self
"""

from __future__ import annotations

import argparse
import asyncio
import os

# litellm fetches a price list from the internet when imported; use its own copy.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from artery.auto import auto_rl
from artery.demos.examples_support import (
    TrainingRun,
    add_llm_flags,
    check_llm_flags,
    example_parser,
    litellm_target,
    make_backend,
)

DEFAULT_TASK = (
    "Read the user's text and fix its grammar and spelling mistakes, wrapping each wrong passage in "
    "<original></original> tags followed by its correction in <corrected></corrected> tags."
)


async def run(args: argparse.Namespace) -> dict:
    async with TrainingRun(args, backend=make_backend(args, service_judge=args.ruler == "service")) as run:
        model = run.model
        generator, generator_params = litellm_target(
            args.generator_model, args.generator_api_base, args.generator_api_key, model
        )
        judge, judge_params = litellm_target(args.judge_model, args.judge_api_base, args.judge_api_key, model)
        result = await auto_rl(
            model,
            args.task,
            num_training_inputs=args.num_inputs,
            groups_per_step=args.groups,
            rollouts_per_group=args.group_size,
            num_epochs=args.epochs,
            max_steps=args.steps,
            learning_rate=args.learning_rate,
            generator_model=generator,
            generator_params=generator_params,
            system_prompt=args.system_prompt,
            judge_model=judge if args.ruler == "agent" else args.judge_model,
            judge_params=judge_params,
            ruler=args.ruler,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            regenerate=args.regenerate,
        )
    run.curve = result.steps  # auto_rl ran the loop and kept the curve
    run.final_step = result.final_step
    summary = run.summary(
        inputs=len(result.inputs.inputs),
        inputs_path=str(result.inputs_path),
        replayed=result.replayed,
        system_prompt=result.inputs.system_prompt,
        judge_failures=result.judge_failures,
    )
    print(f"inputs in {summary['inputs_path']}")
    return summary


def parser() -> argparse.ArgumentParser:
    p = example_parser(
        __doc__,
        model_name="auto-rl-001",
        max_tokens=256,
        temperature=0.7,
        learning_rate=1e-5,
        group_size_help="rollouts per input",
    )
    p.set_defaults(steps=None)  # every batch of every epoch unless limited
    p.add_argument("--task", default=DEFAULT_TASK, help="what the model should learn to do")
    p.add_argument("--num-inputs", type=int, default=16, help="training inputs to generate")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--system-prompt", help="use this system prompt instead of generating one")
    p.add_argument("--regenerate", action="store_true", help="generate new inputs even if stored ones exist")
    add_llm_flags(p, "generator", "openai/gpt-4.1-mini", "a litellm model, or 'self'")
    add_llm_flags(p, "judge", "self", "a litellm model, or 'self' (the trained model)")
    p.add_argument("--ruler", choices=["agent", "service"], default="agent", help="who calls the judge")
    return p


def main(argv: list[str] | None = None) -> dict:
    p = parser()
    args = p.parse_args(argv)
    if args.ruler == "service" and args.judge_model == "self":
        p.error("--ruler service needs an external --judge-model: the service's judge is fixed at start")
    check_llm_flags(p, args, "generator", "judge")
    return asyncio.run(run(args))


if __name__ == "__main__":
    main()
