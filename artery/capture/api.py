"""ART's capture scopes as functions: ``trajectory``, ``trajectory_group``,
``current_trajectory``, ``current_trajectory_group`` and ``no_capture``."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Iterable
from typing import Any

from artery.capture import group_scope, hooks, scope
from artery.gather_context import current_gather
from artery.schemas import TrajectoryException
from artery.trajectories import Trajectory, TrajectoryGroup

no_capture = scope.no_capture


async def trajectory(awaitable: Awaitable[Any]) -> Trajectory:
    """Run ``awaitable`` in a new scope; the trajectory of the model calls it made."""
    with Trajectory() as captured:
        await awaitable
    return captured


async def trajectory_group(
    trajectories: Iterable[Trajectory | BaseException | Awaitable[Any]],
    *,
    exceptions: Iterable[BaseException | TrajectoryException] = (),
    metadata: dict[str, Any] | None = None,
    metrics: dict[str, float | int | bool] | None = None,
    logs: list[str] | None = None,
    return_exceptions: bool = False,
) -> TrajectoryGroup:
    """A group of trajectories, exceptions and rollouts, the rollouts run concurrently (in
    ``gather_trajectory_groups``, counted by its progress bar). Each rollout runs in a scope of its
    own: its trajectory is the one it returns (``art.trajectory(...)``, or one it built), else
    the scope's. A rollout that raised is one of the group's exceptions with
    ``return_exceptions`` (or within ``gather_trajectory_groups``'s ``max_exceptions``), else
    its exception is raised.

    Inside ``with TrajectoryGroup() as g:``, each rollout's trajectory (or exception) is also
    added to ``g`` as it ends, as any trajectory scope ending there is (as in ART)."""
    items = list(trajectories)
    gather = current_gather()
    rollouts = [item for item in items if inspect.isawaitable(item)]
    if gather is not None:
        gather.add_total(len(rollouts))

    async def run(rollout: Awaitable[Any]) -> Trajectory | BaseException:
        captured = Trajectory()
        try:
            # The scope, not ``with captured:``: the enclosing group gets the rollout's result,
            # which is the trajectory it returned when it returned one.
            hooks.install()
            scope.enter(captured)
            try:
                returned = await rollout
            finally:
                scope.leave(captured)
                captured.finish()
        except Exception as exc:
            group_scope.rollout_failed(exc)
            if gather is None and not return_exceptions:
                raise
            if gather is not None:
                gather.record_exception(exc)
            return exc
        result = returned if isinstance(returned, Trajectory) else captured
        group_scope.trajectory_ended(result)
        if gather is not None:
            gather.record_trajectory(result)
        return result

    done = iter(await asyncio.gather(*(run(r) for r in rollouts)))
    results = [next(done) if inspect.isawaitable(item) else item for item in items]
    return TrajectoryGroup(
        [r for r in results if isinstance(r, Trajectory)],
        exceptions=[*(r for r in results if isinstance(r, BaseException)), *exceptions],
        metadata=metadata,
        metrics=metrics,
        logs=logs,
    )


def current_trajectory(*, required: bool = False, require: bool | None = None) -> Trajectory | None:
    """The trajectory of the innermost scope around this call; ``None`` outside one (or under
    ``no_capture``), or a ``RuntimeError`` when ``required`` (ART's newest name: ``require``)."""
    found = scope.current_recorder()
    if isinstance(found, Trajectory):
        return found
    if required or require:
        raise RuntimeError(
            "No trajectory in context: call `current_trajectory(required=True)` inside"
            " `with art.Trajectory():` or `await art.trajectory(...)`."
        )
    return None


def current_trajectory_group(
    *, required: bool = False, require: bool | None = None
) -> TrajectoryGroup | None:
    """The innermost ``with TrajectoryGroup():`` around this call; ``None`` outside one, or a
    ``RuntimeError`` when ``required`` (ART's newest name: ``require``)."""
    found = group_scope.current_group()
    if isinstance(found, TrajectoryGroup):
        return found
    if required or require:
        raise RuntimeError(
            "No trajectory group in context: call `current_trajectory_group(required=True)` inside"
            " `with art.TrajectoryGroup():`."
        )
    return None
