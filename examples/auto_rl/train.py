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
import time
from typing import Any

# litellm fetches a price list from the internet when imported; use its own copy.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import artery as art
from artery.auto import auto_rl

TINY = "artery/tiny-random"
DEFAULT_TASK = (
    "Read the user's text and fix its grammar and spelling mistakes, wrapping each wrong passage in "
    "<original></original> tags followed by its correction in <corrected></corrected> tags."
)


def litellm_target(flag: str, api_base: str | None, api_key: str | None, model: art.TrainableModel):
    """(litellm model name, extra litellm parameters); ``self`` is the trained model's own endpoint."""
    if flag == "self":
        params = model.litellm_completion_params()
        params["max_completion_tokens"] = 1024  # the whole answer must fit a small model's context
        return params.pop("model"), params
    extra: dict[str, Any] = {}
    if api_base:
        extra["api_base"] = api_base
    if api_base or api_key:
        extra["api_key"] = api_key or "none"
    return flag, extra


def make_backend(args: argparse.Namespace) -> art.Backend:
    if args.nats_url:
        return art.Backend(nats_url=args.nats_url, inference_url=args.inference_url)
    backend = art.LocalBackend(path=args.backend_path, inference_env={"ARTERY_INFERENCE_DEVICE": args.device})
    backend.stack.extra_env["ARTERY_TRAINER_DEVICE"] = args.device
    if args.ruler == "service":  # the reward service's judge is the deployment's: here, the one named
        backend.stack.extra_env["ARTERY_REWARD_JUDGE_MODEL"] = args.judge_model
        if args.judge_api_base:
            backend.stack.extra_env["ARTERY_REWARD_JUDGE_API_BASE"] = args.judge_api_base
            backend.stack.extra_env["ARTERY_REWARD_JUDGE_API_KEY"] = args.judge_api_key or "none"
    return backend


async def run(args: argparse.Namespace) -> dict:
    backend = make_backend(args)
    model = art.TrainableModel(
        name=args.model_name, project=args.project, base_model=args.base_model, base_path=args.backend_path
    )
    started = time.monotonic()
    try:
        print(f"registering {args.project}/{args.model_name} ({args.base_model})...", flush=True)
        await model.register(backend)
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
    finally:
        await backend.close()
    summary = {
        "model": f"{args.project}/{args.model_name}",
        "inputs": len(result.inputs.inputs),
        "inputs_path": str(result.inputs_path),
        "replayed": result.replayed,
        "system_prompt": result.inputs.system_prompt,
        "steps": len(result.steps),
        "final_step": result.final_step,
        "judge_failures": result.judge_failures,
        "curve": result.steps,
        "wall_time_s": round(time.monotonic() - started, 1),
    }
    print(
        f"done: {summary['steps']} steps in {summary['wall_time_s']}s; the model is at step "
        f"{summary['final_step']}; inputs in {summary['inputs_path']}"
    )
    return summary


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--task", default=DEFAULT_TASK, help="what the model should learn to do")
    p.add_argument("--base-model", default=TINY, help="a local directory or a name the stack resolves")
    p.add_argument("--num-inputs", type=int, default=16, help="training inputs to generate")
    p.add_argument("--groups", type=int, default=2, help="inputs (groups) per step")
    p.add_argument("--group-size", type=int, default=4, help="rollouts per input")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--steps", type=int, help="stop after this many steps (default: every batch)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--learning-rate", type=float, default=1e-5)
    p.add_argument("--system-prompt", help="use this system prompt instead of generating one")
    p.add_argument("--regenerate", action="store_true", help="generate new inputs even if stored ones exist")
    p.add_argument("--generator-model", default="openai/gpt-4.1-mini", help="a litellm model, or 'self'")
    p.add_argument("--generator-api-base", help="an OpenAI-compatible base URL for --generator-model")
    p.add_argument("--generator-api-key", default=os.environ.get("ARTERY_GENERATOR_API_KEY"))
    p.add_argument("--judge-model", default="self", help="a litellm model, or 'self' (the trained model)")
    p.add_argument("--judge-api-base", help="an OpenAI-compatible base URL for --judge-model")
    p.add_argument("--judge-api-key", default=os.environ.get("ARTERY_JUDGE_API_KEY"))
    p.add_argument("--ruler", choices=["agent", "service"], default="agent", help="who calls the judge")
    p.add_argument("--project", default="examples")
    p.add_argument("--model-name", default="auto-rl-001", help="a re-run with the same name resumes it")
    p.add_argument("--backend-path", default=".artery", help="LocalBackend's directory (stack, history)")
    p.add_argument("--device", default="cpu", help="LocalBackend's trainer and inference device")
    p.add_argument("--nats-url", help="join a deployed Artery (art.Backend) instead of starting one")
    p.add_argument("--inference-url", help="with --nats-url: the OpenAI-compatible base URL (.../v1)")
    return p


def main(argv: list[str] | None = None) -> dict:
    p = parser()
    args = p.parse_args(argv)
    if args.ruler == "service" and args.judge_model == "self":
        p.error("--ruler service needs an external --judge-model: the service's judge is fixed at start")
    for flag in ("generator", "judge"):
        if getattr(args, f"{flag}_api_base") and getattr(args, f"{flag}_model") == "self":
            p.error(f"--{flag}-api-base needs --{flag}-model openai/<name>, not self")
    return asyncio.run(run(args))


if __name__ == "__main__":
    main()
