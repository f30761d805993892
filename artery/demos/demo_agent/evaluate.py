"""Held-out evaluation of the demo-agent: fixed questions, greedy and seeded samples, before and after.

The figures have the demo's shape (``greedy``/``sampled``: mean reward), plus the success rate
(share of episodes scoring 1.0), tool-call validity (calls that parsed and ran, out of all calls),
the share of episodes with a valid call, turns per episode, and success by kind of question.
"""

from __future__ import annotations

import statistics
from collections.abc import Awaitable, Callable, Sequence

import artery as art
from artery.demos.demo_agent.task import Question

#: (question, temperature, seed, inference name) -> one scored episode.
Rollout = Callable[[Question, float, int | None, str | None], Awaitable[art.Trajectory]]


def figures(trajectories: Sequence[art.Trajectory]) -> dict[str, float]:
    """Means over episodes; tool-call validity over calls (1.0 when no call was made at all)."""
    ts = list(trajectories)
    calls = sum(t.metrics["tool_calls"] for t in ts)
    return {
        "reward": statistics.fmean(t.reward for t in ts),
        "success": statistics.fmean(t.reward == 1.0 for t in ts),
        "valid_call": statistics.fmean(t.metrics["valid_call"] for t in ts),
        "tool_call_validity": sum(t.metrics["valid_calls"] for t in ts) / calls if calls else 1.0,
        "turns": statistics.fmean(t.metrics["turns"] for t in ts),
    }


async def evaluate(
    rollout: Rollout,
    items: Sequence[Question],
    samples: int,
    inference_name: str,
    step: int,
    temperature: float = 1.0,
) -> dict:
    """Each item answered greedily once and sampled ``samples`` times with seeds fixed by position
    (the same before and after training); one progress bar."""
    greedy, sampled = await art.gather_trajectory_groups(
        [
            art.trajectory_group(rollout(q, 0.0, None, inference_name) for q in items),
            art.trajectory_group(
                rollout(q, temperature, 1000 * i + 10 * k, inference_name)
                for i, q in enumerate(items)
                for k in range(samples)
            ),
        ],
        pbar_desc=f"held-out eval @{step}",
    )
    g, s = figures(list(greedy)), figures(list(sampled))
    result: dict = {"step": step, "greedy": g["reward"], "sampled": s["reward"]}
    for key in ("success", "valid_call", "tool_call_validity", "turns"):
        result[f"greedy_{key}"] = g[key]
        result[f"sampled_{key}"] = s[key]
    kinds = sorted({q.kind for q in items})
    result["sampled_success_by_kind"] = {
        kind: statistics.fmean(t.reward == 1.0 for t in sampled if t.metadata["kind"] == kind)
        for kind in kinds
    }
    result["answers"] = [
        {"question": t.metadata["question"], "final": t.metadata["final"], "reward": t.reward}
        for t in list(greedy)[:4]
    ]
    return result
