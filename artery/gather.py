"""Running many rollouts at once: ``gather_trajectory_groups`` and ``gather_trajectories``.

A gather sets a ``GatherContext`` (``artery.gather_context``) that the awaitable
``TrajectoryGroup``s inside it report to.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from artery.dev import note_no_effect
from artery.gather_context import GatherContext, TooManyExceptions, _current, current_gather
from artery.shared.tracing import tracer
from artery.trajectories import Trajectory, TrajectoryGroup
from artery.unstarted import close_unstarted

__all__ = [
    "GatherContext",
    "TooManyExceptions",
    "current_gather",
    "gather_trajectories",
    "gather_trajectory_groups",
]

_tracer = tracer("artery.sdk")


def _note_token_total(asked: bool) -> None:
    if asked:
        note_no_effect("pbar_total_completion_tokens=True", "the bar counts rollouts and shows mean metrics")


AfterEach = Callable[[TrajectoryGroup], Awaitable[TrajectoryGroup | list[TrajectoryGroup] | None]]


async def gather_trajectory_groups(
    groups: Iterable[Awaitable[TrajectoryGroup]],
    *,
    pbar_desc: str = "gather",
    pbar_total_completion_tokens: bool = False,
    max_exceptions: int | float = 0,
    max_metrics: int | None = None,
    after_each: AfterEach | None = None,
) -> list[TrajectoryGroup]:
    """Await every group concurrently; return them in the order given.

    ``pbar_total_completion_tokens`` is ART's older switch for a token count on the bar; accepted
    (ART deprecated it), it changes nothing here.

    ``after_each`` runs on each finished group (scoring, filtering): ``None`` drops the group,
    a list replaces it with several.
    """
    _note_token_total(pbar_total_completion_tokens)
    context = GatherContext(pbar_desc, max_exceptions, max_metrics)
    token = _current.set(context)
    try:
        # Each group task copies the context, so the groups see this gather.
        async def finish(awaitable: Awaitable[TrajectoryGroup]) -> list[TrajectoryGroup]:
            group = await awaitable
            if after_each is None:
                return [group]
            result = await after_each(group)
            if result is None:
                return []
            return result if isinstance(result, list) else [result]

        awaitables = list(groups)
        try:
            results = await asyncio.gather(*(finish(g) for g in awaitables))
        finally:  # one raised (max_exceptions): the groups that never started are closed
            close_unstarted(awaitables)
    finally:
        _current.reset(token)
        context.close()
    return [group for batch in results for group in batch]


async def gather_trajectories(
    trajectories: Iterable[Awaitable[Trajectory]],
    *,
    pbar_desc: str = "gather",
    pbar_total_completion_tokens: bool = False,
    max_exceptions: int | float = 0,
) -> list[Trajectory]:
    """Like ``gather_trajectory_groups`` for loose trajectories; raised ones are left out.
    ``pbar_total_completion_tokens``: as in ``gather_trajectory_groups``, accepted, no effect."""
    _note_token_total(pbar_total_completion_tokens)
    context = GatherContext(pbar_desc, max_exceptions)
    token = _current.set(context)
    items = list(trajectories)
    context.add_total(len(items))

    async def run(awaitable: Awaitable[Trajectory]) -> Trajectory | None:
        try:
            with _tracer.start_as_current_span("artery.rollout"):
                trajectory = await awaitable
        except Exception as exc:
            context.record_exception(exc)
            return None
        context.record_trajectory(trajectory)
        return trajectory

    try:
        results: list[Any] = await asyncio.gather(*(run(t) for t in items))
    finally:
        close_unstarted(items)
        _current.reset(token)
        context.close()
    return [t for t in results if t is not None]
