"""A multi-turn agent that uses a calculator tool, scored by RULER, trained with GRPO.

The agent is asked an arithmetic question and given one tool through the OpenAI tools API
(``tools=[calculator]``). Each turn it sends the conversation so far; when the model answers with
``tool_calls`` the agent runs them and appends the results as ``role="tool"`` messages, and it
stops at an answer without tool calls or after ``--max-turns``. The whole history (with the
``Choice`` objects, so the sampled tokens are kept) is the trajectory. Each group of rollouts of the
same question is then scored by an LLM judge with ``art.rewards.ruler_score_group``: by default the
stack's own model (``model.litellm_completion_params()``), or any litellm model with
``--judge-model`` (and ``--judge-api-base`` for an OpenAI-compatible server). Whether the answer
was right is kept as ``metrics["independent_reward"]``.

    python examples/tool_use/train.py --steps 10
    python examples/tool_use/train.py --judge-model openai/gpt-4.1-mini      # OPENAI_API_KEY set
    python examples/tool_use/train.py --nats-url nats://host:4222 --base-model Qwen/Qwen2.5-0.5B-Instruct
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import time
from typing import Any

# litellm (the judge's client) fetches a price list from the internet when imported; use its copy.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import artery as art
from artery.demos.demo_agent.task import calculate  # the same safe calculator as make demo-agent

#: The tiny random Qwen2 built locally (no model hub): gibberish answers, but every path runs.
TINY = "artery/tiny-random"
SYSTEM = (
    "You are a careful assistant. Use the calculator tool for any arithmetic, "
    "then reply with the final number only."
)
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "for example (12 + 7) * 3"}},
                "required": ["expression"],
            },
        },
    }
]
RUBRIC = """
- The goal is the correct final number. A trajectory with the correct final answer must score higher than one without.
- Using the calculator tool with a sensible expression is better than guessing.
- Malformed tool calls, calls to tools that do not exist and unnecessary extra turns lower the score.
- Give partial credit for progress (a correct tool call without a final answer is better than nothing).
"""  # noqa: E501


def run_tool(name: str, arguments: str) -> tuple[str, bool]:
    """The tool's result as the content of a ``role="tool"`` message, and whether it succeeded."""
    try:
        if name != "calculator":
            raise ValueError(f"unknown tool {name!r}; the only tool is 'calculator'")
        args = json.loads(arguments or "{}")
        if not isinstance(args, dict) or not isinstance(args.get("expression"), str):
            raise ValueError('expected arguments {"expression": "<arithmetic>"}')
        result = calculate(args["expression"])
    except (ValueError, TypeError, OverflowError) as exc:  # json.JSONDecodeError is a ValueError
        return json.dumps({"error": str(exc)}), False
    return json.dumps({"result": int(result) if float(result).is_integer() else round(result, 6)}), True


def make_task(rng: random.Random) -> tuple[str, int]:
    a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 20)
    op = rng.choice("+-")
    answer = a * c + b if op == "+" else a * c - b
    return f"What is {a} * {c} {op} {b}?", answer


def is_correct(text: str, answer: int) -> bool:
    numbers = re.findall(r"-?\d+(?:\.\d+)?", text.replace(",", ""))
    return bool(numbers) and float(numbers[-1]) == answer


async def rollout(
    client: Any,
    model_name: str,
    question: str,
    answer: int,
    *,
    max_turns: int = 4,
    max_tokens: int = 48,
    temperature: float = 1.0,
) -> art.Trajectory:
    """One episode of the agent loop; ``client`` is an ``openai.AsyncOpenAI`` (``model.openai_client()``)."""
    trajectory = art.Trajectory(
        messages_and_choices=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        tools=TOOLS,
        metadata={"question": question, "answer": answer},
    )
    calls = errors = turns = 0
    final: str | None = None
    while turns < max_turns:
        turns += 1
        response = await client.chat.completions.create(
            model=model_name,
            messages=trajectory.messages(),  # the history so far, choices as assistant messages
            tools=TOOLS,
            max_tokens=max_tokens,
            temperature=temperature,
            logprobs=True,
        )
        choice = response.choices[0]
        trajectory.messages_and_choices.append(choice)  # keeps the sampled token ids and logprobs
        tool_calls = choice.message.tool_calls or []
        if not tool_calls:
            final = choice.message.content or ""
            break
        for call in tool_calls:
            content, ok = run_tool(call.function.name, call.function.arguments)
            calls += 1
            errors += not ok
            trajectory.messages_and_choices.append(
                {"role": "tool", "tool_call_id": call.id, "content": content}
            )
    correct = final is not None and is_correct(final, answer)
    trajectory.reward = float(correct)  # replaced by RULER's score; kept as metrics["independent_reward"]
    trajectory.metrics.update(
        correct=float(correct),
        turns=turns,
        tool_calls=calls,
        tool_errors=errors,
        answered=float(final is not None),
    )
    trajectory.metadata["final"] = final
    return trajectory.finish()


def judge(args: argparse.Namespace, model: art.TrainableModel) -> tuple[str, dict[str, Any]]:
    """The judge's litellm model name and extra parameters."""
    if args.judge_model:
        extra: dict[str, Any] = {}
        if args.judge_api_base:
            extra["api_base"] = args.judge_api_base
        if args.judge_api_base or args.judge_api_key:
            extra["api_key"] = args.judge_api_key or "none"
        if args.judge_max_tokens:
            extra["max_tokens"] = args.judge_max_tokens
        return args.judge_model, extra
    params = model.litellm_completion_params()  # the model being trained judges its own group
    params["max_tokens"] = args.judge_max_tokens or 512
    return params.pop("model"), params


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
    judge_failures = 0
    try:
        print(f"registering {args.project}/{args.model_name} ({args.base_model})...", flush=True)
        await model.register(backend)
        if model.inference_base_url is None:
            raise SystemExit(
                f"no inference replica serves {args.project}/{args.model_name}: start one (artery up "
                f"--serve {args.project}/{args.model_name}={args.base_model}) or pass --inference-url"
            )
        judge_model, judge_params = judge(args, model)
        print(f"ready in {time.monotonic() - started:.1f}s; judge: {judge_model}", flush=True)

        async def score(group: art.TrajectoryGroup) -> art.TrajectoryGroup | None:
            nonlocal judge_failures
            try:
                return await art.rewards.ruler_score_group(
                    group, judge_model, extra_litellm_params=judge_params, rubric=RUBRIC
                )
            except Exception as exc:  # an unusable answer (twice), or the call failed
                judge_failures += 1
                what = "its own rewards" if args.on_judge_failure == "independent" else "dropped"
                print(f"the judge could not score a group ({what}): {str(exc)[:200]!r}", flush=True)
                return group if args.on_judge_failure == "independent" else None

        for _ in range(args.steps):
            step = await model.get_step()
            client, name = model.openai_client(), model.get_inference_name()
            groups = await art.gather_trajectory_groups(
                (
                    art.TrajectoryGroup(
                        rollout(
                            client,
                            name,
                            question,
                            answer,
                            max_turns=args.max_turns,
                            max_tokens=args.max_tokens,
                            temperature=args.temperature,
                        )
                        for _ in range(args.group_size)
                    )
                    for question, answer in (make_task(rng) for _ in range(args.groups))
                ),
                pbar_desc=f"step {step} rollouts",
                max_exceptions=args.group_size * args.groups // 4,
                after_each=score,
            )
            groups = [g for g in groups if len(g)]
            if not groups:
                print(f"step {step:>3}: every group was dropped (judge failures); nothing to train")
                continue
            trajectories = [t for g in groups for t in g]
            result = await model.train(groups, config=art.TrainConfig(learning_rate=args.learning_rate))
            point = {
                "step": step,
                "new_step": result.step,
                "reward": statistics.fmean(t.reward for t in trajectories),
                "accuracy": statistics.fmean(t.metrics["correct"] for t in trajectories),
                "tool_calls": statistics.fmean(t.metrics["tool_calls"] for t in trajectories),
                "turns": statistics.fmean(t.metrics["turns"] for t in trajectories),
                "ruler_scored": sum("ruler_score" in t.metrics for t in trajectories),
                "trajectories": len(trajectories),
                "trained": bool(result.metrics.get("trained", 1.0)),
                "loss": result.metrics.get("loss"),
            }
            curve.append(point)
            print(
                f"step {result.step:>3}: reward {point['reward']:.3f}  accuracy {point['accuracy']:.2f}  "
                f"tool calls {point['tool_calls']:.2f}  turns {point['turns']:.2f}  "
                f"RULER-scored {point['ruler_scored']}/{len(trajectories)}  "
                + (f"loss {point['loss']:+.4f}" if point["trained"] else "nothing trained (equal rewards)"),
                flush=True,
            )
        final_step = await model.get_step()
    finally:
        await backend.close()
    summary = {
        "model": f"{args.project}/{args.model_name}",
        "steps": len(curve),
        "final_step": final_step,
        "judge_failures": judge_failures,
        "wall_time_s": round(time.monotonic() - started, 1),
        "curve": curve,
    }
    print(
        f"done: {len(curve)} steps in {summary['wall_time_s']}s; the model is at step {final_step}; "
        f"{judge_failures} groups the judge could not score"
    )
    return summary


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base-model", default=TINY, help="a local directory or a name the stack resolves")
    p.add_argument("--steps", type=int, default=10, help="training steps in this run")
    p.add_argument("--groups", type=int, default=2, help="questions (groups) per step")
    p.add_argument("--group-size", type=int, default=4, help="rollouts per question")
    p.add_argument("--max-turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=48, help="per model turn")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--learning-rate", type=float, default=1e-2)
    p.add_argument("--judge-model", help="a litellm model name (default: the trained model, on the stack)")
    p.add_argument("--judge-api-base", help="an OpenAI-compatible base URL for --judge-model")
    p.add_argument("--judge-api-key", default=os.environ.get("ARTERY_JUDGE_API_KEY"))
    p.add_argument(
        "--judge-max-tokens", type=int, help="the judge's answer length (default: 512 for the self-judge)"
    )
    p.add_argument(
        "--on-judge-failure",
        choices=["independent", "drop"],
        default="independent",
        help="a group the judge cannot score: train on its own rewards (correct or not), or drop it",
    )
    p.add_argument("--project", default="examples")
    p.add_argument("--model-name", default="tool-use-001", help="a re-run with the same name resumes it")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend-path", default=".artery", help="LocalBackend's directory (stack, history)")
    p.add_argument("--device", default="cpu", help="LocalBackend's trainer and inference device")
    p.add_argument("--nats-url", help="join a deployed Artery (art.Backend) instead of starting one")
    p.add_argument("--inference-url", help="with --nats-url: the OpenAI-compatible base URL (.../v1)")
    return p


def main(argv: list[str] | None = None) -> dict:
    p = parser()
    args = p.parse_args(argv)
    if args.judge_api_base and not args.judge_model:
        p.error("--judge-api-base needs --judge-model (e.g. openai/<name> for an OpenAI-compatible server)")
    return asyncio.run(run(args))


if __name__ == "__main__":
    main()
