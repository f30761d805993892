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
import sys
from pathlib import Path
from typing import Any

# litellm (generator and judge client) fetches a price list from the internet when imported; use its copy.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import artery as art
from artery.demos.examples_support import (
    TrainingRun,
    add_llm_flags,
    check_llm_flags,
    example_parser,
    litellm_target,
    make_backend,
)
from artery.mcp import (
    GeneratedScenarioCollection,
    execute_tool_calls,
    generate_scenarios,
    list_tools_and_resources,
    mcp_session,
    tools_to_openai,
)

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
    server: Any = args.mcp_url or art_stdio_server()
    judge_failures = 0
    async with TrainingRun(args, backend=make_backend(args, service_judge=args.ruler == "service")) as run:
        model = run.model
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
            run.ready(f"judge {judge_name} ({args.ruler})")

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
                await run.train(
                    [g for g in groups if len(g)],
                    tool_calls=lambda t: t.metrics["tool_calls"],
                    tool_errors=lambda t: t.metrics["tool_errors"],
                    completed=lambda t: t.metrics["task_completed"],
                    turns=lambda t: t.metrics["turns"],
                )
    return run.summary(
        tools=[t.name for t in tools],
        resources=[r.uri for r in resources],
        scenarios=len(scenarios),
        scenarios_path=str(scenarios_path),
        judge_failures=judge_failures,
    )


def art_stdio_server():
    """Our unit-conversion server, started by the MCP client over stdio with this interpreter."""
    from mcp import StdioServerParameters

    return StdioServerParameters(command=sys.executable, args=[str(SERVER)])


def parser() -> argparse.ArgumentParser:
    p = example_parser(
        __doc__,
        model_name="mcp-rl-001",
        steps=4,
        max_tokens_help="per model turn",
        groups_help="scenarios (groups) per step",
        group_size_help="rollouts per scenario",
    )
    p.add_argument("--num-scenarios", type=int, help="scenarios to generate (default: steps x groups)")
    p.add_argument("--max-turns", type=int, default=3)
    p.add_argument("--mcp-url", help="a streamable-HTTP MCP server instead of our stdio server.py")
    p.add_argument("--scenarios", help="a scenarios JSON file to replay instead of generating")
    p.add_argument("--custom-instructions", help="extra instructions for the scenario generator")
    add_llm_flags(p, "generator", "openai/gpt-4.1-mini", "a litellm model, or 'self'")
    add_llm_flags(p, "judge", "self", "a litellm model, or 'self' (the trained model)")
    p.add_argument(
        "--ruler",
        choices=["service", "agent"],
        help="who calls the judge: the reward service (default with an external judge) or this process",
    )
    return p


def main(argv: list[str] | None = None) -> dict:
    p = parser()
    args = p.parse_args(argv)
    if args.judge_model == "self":
        if args.ruler == "service":
            p.error("--ruler service needs an external --judge-model: the service's judge is fixed at start")
        args.ruler = "agent"
    args.ruler = args.ruler or "service"
    check_llm_flags(p, args, "generator", "judge")
    return asyncio.run(run(args))


if __name__ == "__main__":
    main()
