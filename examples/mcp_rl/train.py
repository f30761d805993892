"""MCP•RL: teach a model to use an MCP server, with generated scenarios and RULER, no labelled data.

1. Start our MCP server (``server.py``: unit conversion, four tools and a resource) over stdio, or
   connect to any streamable-HTTP MCP server with ``--mcp-url``; list its tools and resources.
2. Generate training scenarios for them with an LLM (``art.mcp.generate_scenarios``), stored as
   JSON under the model's directory (``mcp_rl_scenarios.json``); ``--scenarios FILE`` replays a file.
3. Each rollout gives the model the server's tools plus ``complete_task`` (OpenAI ``tools``; our
   inference renders them and parses Hermes ``<tool_call>`` answers into ``tool_calls``). Each tool
   call runs through the MCP client and comes back as a ``role="tool"`` message; ``complete_task``,
   an answer without a tool call, or ``--max-turns`` ends the episode.
4. RULER scores each group: by the reward service (``TrajectoryGroup(reward=RewardSpec(ruler=...))``,
   the default with an external judge) or in this process (``--ruler agent``; always for
   ``--judge-model self``); ``model.train`` takes a step.

The generator and the judge are chosen by flags: a provider through litellm
(``--generator-model openai/gpt-4.1-mini``, with its usual key variable), any OpenAI-compatible
server (``--generator-api-base URL`` with ``--generator-model openai/<name>``), or ``self``:
Artery's own endpoint serving the model being trained (fine as a judge for a real base model;
the tiny test model cannot write scenarios).

    python examples/mcp_rl/train.py --generator-model openai/gpt-4.1-mini --judge-model openai/o4-mini
    python examples/mcp_rl/train.py --base-model Qwen/Qwen2.5-1.5B-Instruct --generator-model self
    python examples/mcp_rl/train.py --scenarios .artery/examples/models/mcp-rl-001/mcp_rl_scenarios.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

# litellm (generator and judge client) fetches a price list from the internet when imported; use its copy.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import artery as art
from artery.mcp import (
    GeneratedScenarioCollection,
    execute_tool_calls,
    generate_scenarios,
    list_tools_and_resources,
    mcp_session,
    tools_to_openai,
)

#: The tiny random Qwen2 built locally (no model hub): it rarely writes a valid tool call.
TINY = "artery/tiny-random"
SERVER = Path(__file__).resolve().parent / "server.py"
SCENARIOS_FILE = "mcp_rl_scenarios.json"
SYSTEM = (
    "You are an MCP (Model Context Protocol) agent. Use the server's tools to complete the task. "
    "When you have completed it, call the 'complete_task' function with a summary of what you "
    "accomplished. You have a total of {max_turns} turns."
)
RUBRIC = """
- A trajectory that completes the task, with correct tool calls and a correct final summary, scores highest.
- Calling the right tools with valid arguments is better than guessing; errors from malformed calls or unknown tools lower the score.
- Finishing with complete_task and a summary that reports the results is better than stopping without one.
- Give partial credit for progress (a correct tool call without a summary is better than nothing).
"""  # noqa: E501


async def rollout(
    client: Any,
    model_name: str,
    session: Any,
    tools: list[dict[str, Any]],
    task: str,
    *,
    max_turns: int = 3,
    max_tokens: int = 128,
    temperature: float = 1.0,
) -> art.Trajectory:
    """One episode: the model's tool calls run through the MCP ``session`` until it completes or stops."""
    trajectory = art.Trajectory(
        messages_and_choices=[
            {"role": "system", "content": SYSTEM.format(max_turns=max_turns)},
            {"role": "user", "content": f"Please complete this task: {task}"},
        ],
        tools=tools,
        metadata={"task": task[:500]},
    )
    calls = errors = turns = 0
    completed = False
    summary: str | None = None
    while turns < max_turns and not completed:
        turns += 1
        response = await client.chat.completions.create(
            model=model_name,
            messages=trajectory.messages(),
            tools=tools,
            max_tokens=max_tokens,
            temperature=temperature,
            logprobs=True,
        )
        choice = response.choices[0]
        trajectory.messages_and_choices.append(choice)  # keeps the sampled token ids and logprobs
        tool_calls = choice.message.tool_calls or []
        if not tool_calls:
            break  # an answer without a tool call ends the episode
        outcome = await execute_tool_calls(session, tool_calls)
        trajectory.messages_and_choices.extend(outcome.messages)
        calls += outcome.calls
        errors += outcome.errors
        completed, summary = outcome.completed, outcome.summary
    trajectory.reward = float(completed)  # replaced by RULER's; kept as metrics["independent_reward"]
    trajectory.metrics.update(
        turns=turns,
        tool_calls=calls,
        tool_errors=errors,
        task_completed=float(completed),
        ran_out_of_turns=float(not completed and turns >= max_turns),
    )
    if summary is not None:
        trajectory.metadata["summary"] = summary[:500]
    return trajectory.finish()


def litellm_target(model_flag: str, api_base: str | None, api_key: str | None, model: art.TrainableModel):
    """(litellm model name, extra litellm parameters) for ``--*-model``; ``self`` is the stack's model."""
    if model_flag == "self":
        params = model.litellm_completion_params()
        params["max_completion_tokens"] = 1024  # the whole answer must fit a small model's context
        return params.pop("model"), params
    extra: dict[str, Any] = {}
    if api_base:
        extra["api_base"] = api_base
    if api_base or api_key:
        extra["api_key"] = api_key or "none"
    return model_flag, extra


def make_backend(args: argparse.Namespace) -> art.Backend:
    if args.nats_url:
        return art.Backend(nats_url=args.nats_url, inference_url=args.inference_url)
    backend = art.LocalBackend(path=args.backend_path, inference_env={"ARTERY_INFERENCE_DEVICE": args.device})
    backend.stack.extra_env["ARTERY_TRAINER_DEVICE"] = args.device
    if args.ruler == "service":
        # The reward service's judge is the deployment's: on the embedded stack, the one named here.
        backend.stack.extra_env.update(
            {
                "ARTERY_REWARD_JUDGE_MODEL": args.judge_model,
                **({"ARTERY_REWARD_JUDGE_API_BASE": args.judge_api_base} if args.judge_api_base else {}),
                **(
                    {"ARTERY_REWARD_JUDGE_API_KEY": args.judge_api_key or "none"}
                    if args.judge_api_base
                    else {}
                ),
            }
        )
    return backend


async def load_or_generate_scenarios(
    args: argparse.Namespace, model: art.TrainableModel, tools, resources, count: int
) -> tuple[GeneratedScenarioCollection, Path]:
    path = model.directory / SCENARIOS_FILE
    if args.scenarios:
        scenarios = GeneratedScenarioCollection.load(args.scenarios)
        print(f"replaying {len(scenarios)} scenarios from {args.scenarios}", flush=True)
    else:
        name, extra = litellm_target(
            args.generator_model, args.generator_api_base, args.generator_api_key, model
        )
        print(f"generating {count} scenarios with {name}...", flush=True)
        scenarios = await generate_scenarios(
            tools,
            resources,
            num_scenarios=count,
            show_preview=True,
            custom_instructions=args.custom_instructions,
            generator_model=name,
            extra_litellm_params=extra,
        )
    if Path(args.scenarios or "").resolve() != path.resolve():
        scenarios.save(path)  # stored with the run, so that it can be replayed
    return scenarios, path


async def run(args: argparse.Namespace) -> dict:
    backend = make_backend(args)
    model = art.TrainableModel(
        name=args.model_name, project=args.project, base_model=args.base_model, base_path=args.backend_path
    )
    server: Any = args.mcp_url or art_stdio_server()
    started = time.monotonic()
    curve: list[dict] = []
    judge_failures = 0
    try:
        print(f"registering {args.project}/{args.model_name} ({args.base_model})...", flush=True)
        await model.register(backend)
        if model.inference_base_url is None:
            raise SystemExit(f"no inference replica serves {args.project}/{args.model_name}")
        async with mcp_session(server) as session:
            tools, resources = await list_tools_and_resources(session)
            print(f"MCP server: tools {[t.name for t in tools]}, resources {[r.uri for r in resources]}")
            openai_tools = tools_to_openai(tools)  # plus complete_task
            count = args.num_scenarios or args.steps * args.groups
            scenarios, scenarios_path = await load_or_generate_scenarios(args, model, tools, resources, count)
            tasks = [s.task for s in scenarios]
            random.Random(args.seed).shuffle(tasks)

            judge_name, judge_params = litellm_target(
                args.judge_model, args.judge_api_base, args.judge_api_key, model
            )
            spec = (
                art.RewardSpec(ruler=art.RulerSpec(judge_model=args.judge_model, rubric=RUBRIC))
                if args.ruler == "service"
                else None
            )
            print(
                f"ready in {time.monotonic() - started:.1f}s; judge {judge_name} ({args.ruler})", flush=True
            )

            async def score(group: art.TrajectoryGroup) -> art.TrajectoryGroup | None:
                nonlocal judge_failures
                if args.ruler == "service":
                    return group  # the reward service judges it before the trainer uses it
                try:
                    return await art.rewards.ruler_score_group(
                        group, judge_name, extra_litellm_params=judge_params, rubric=RUBRIC
                    )
                except Exception as exc:
                    judge_failures += 1
                    print(f"the judge could not score a group (its own rewards): {str(exc)[:200]!r}")
                    return group

            for i in range(args.steps):
                step = await model.get_step()
                client, name = model.openai_client(), model.get_inference_name()
                batch = [tasks[(i * args.groups + j) % len(tasks)] for j in range(args.groups)]
                groups = await art.gather_trajectory_groups(
                    (
                        art.TrajectoryGroup(
                            (
                                rollout(
                                    client,
                                    name,
                                    session,
                                    openai_tools,
                                    task,
                                    max_turns=args.max_turns,
                                    max_tokens=args.max_tokens,
                                    temperature=args.temperature,
                                )
                                for _ in range(args.group_size)
                            ),
                            reward=spec,
                            metadata={"task": task[:500]},
                        )
                        for task in batch
                    ),
                    pbar_desc=f"step {step} rollouts",
                    max_exceptions=args.group_size * args.groups // 4,
                    after_each=score,
                )
                groups = [g for g in groups if len(g)]
                trajectories = [t for g in groups for t in g]
                result = await model.train(groups, config=art.TrainConfig(learning_rate=args.learning_rate))
                point = {
                    "step": step,
                    "new_step": result.step,
                    "reward": result.metrics.get("reward_mean"),
                    "tool_calls": statistics.fmean(t.metrics["tool_calls"] for t in trajectories),
                    "tool_errors": statistics.fmean(t.metrics["tool_errors"] for t in trajectories),
                    "completed": statistics.fmean(t.metrics["task_completed"] for t in trajectories),
                    "turns": statistics.fmean(t.metrics["turns"] for t in trajectories),
                    "trajectories": len(trajectories),
                    "trained": bool(result.metrics.get("trained", 1.0)),
                    "loss": result.metrics.get("loss"),
                }
                curve.append(point)
                reward = "n/a" if point["reward"] is None else f"{point['reward']:.3f}"
                print(
                    f"step {result.step:>3}: reward {reward}  tool calls {point['tool_calls']:.2f}  "
                    f"errors {point['tool_errors']:.2f}  completed {point['completed']:.2f}  "
                    f"turns {point['turns']:.2f}",
                    flush=True,
                )
        final_step = await model.get_step()
    finally:
        await backend.close()
    summary = {
        "model": f"{args.project}/{args.model_name}",
        "tools": [t.name for t in tools],
        "resources": [r.uri for r in resources],
        "scenarios": len(scenarios),
        "scenarios_path": str(scenarios_path),
        "steps": len(curve),
        "final_step": final_step,
        "judge_failures": judge_failures,
        "wall_time_s": round(time.monotonic() - started, 1),
        "curve": curve,
    }
    print(f"done: {len(curve)} steps in {summary['wall_time_s']}s; the model is at step {final_step}")
    return summary


def art_stdio_server():
    """Our unit-conversion server, started by the MCP client over stdio with this interpreter."""
    from mcp import StdioServerParameters

    return StdioServerParameters(command=sys.executable, args=[str(SERVER)])


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base-model", default=TINY, help="a local directory or a name the stack resolves")
    p.add_argument("--steps", type=int, default=4, help="training steps in this run")
    p.add_argument("--groups", type=int, default=2, help="scenarios (groups) per step")
    p.add_argument("--group-size", type=int, default=4, help="rollouts per scenario")
    p.add_argument("--num-scenarios", type=int, help="scenarios to generate (default: steps x groups)")
    p.add_argument("--max-turns", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128, help="per model turn")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--learning-rate", type=float, default=1e-2)
    p.add_argument("--mcp-url", help="a streamable-HTTP MCP server instead of our stdio server.py")
    p.add_argument("--scenarios", help="a scenarios JSON file to replay instead of generating")
    p.add_argument("--custom-instructions", help="extra instructions for the scenario generator")
    p.add_argument("--generator-model", default="openai/gpt-4.1-mini", help="a litellm model, or 'self'")
    p.add_argument("--generator-api-base", help="an OpenAI-compatible base URL for --generator-model")
    p.add_argument("--generator-api-key", default=os.environ.get("ARTERY_GENERATOR_API_KEY"))
    p.add_argument("--judge-model", default="self", help="a litellm model, or 'self' (the trained model)")
    p.add_argument("--judge-api-base", help="an OpenAI-compatible base URL for --judge-model")
    p.add_argument("--judge-api-key", default=os.environ.get("ARTERY_JUDGE_API_KEY"))
    p.add_argument(
        "--ruler",
        choices=["service", "agent"],
        help="who calls the judge: the reward service (default with an external judge) or this process",
    )
    p.add_argument("--project", default="examples")
    p.add_argument("--model-name", default="mcp-rl-001", help="a re-run with the same name resumes it")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend-path", default=".artery", help="LocalBackend's directory (stack, history)")
    p.add_argument("--device", default="cpu", help="LocalBackend's trainer and inference device")
    p.add_argument("--nats-url", help="join a deployed Artery (art.Backend) instead of starting one")
    p.add_argument("--inference-url", help="with --nats-url: the OpenAI-compatible base URL (.../v1)")
    return p


def main(argv: list[str] | None = None) -> dict:
    p = parser()
    args = p.parse_args(argv)
    if args.judge_model == "self":
        if args.ruler == "service":
            p.error("--ruler service needs an external --judge-model: the service's judge is fixed at start")
        args.ruler = "agent"
    args.ruler = args.ruler or "service"
    for flag in ("generator", "judge"):
        if getattr(args, f"{flag}_api_base") and getattr(args, f"{flag}_model") == "self":
            p.error(f"--{flag}-api-base needs --{flag}-model openai/<name>, not self")
    return asyncio.run(run(args))


if __name__ == "__main__":
    main()
