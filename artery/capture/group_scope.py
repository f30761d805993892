"""``with art.TrajectoryGroup() as g:``: which group collects the trajectories ending here. A
context variable, as the trajectory scopes are, so the group follows the rollouts into the tasks
and threads they start; each trajectory scope that ends in it adds its trajectory to the innermost
group (once, in completion order), or its exception to the group's exceptions."""

from __future__ import annotations

import contextvars
import traceback
import weakref
from typing import Any, Protocol

from artery.capture import scope
from artery.schemas import TrajectoryException


class Collector(Protocol):
    """What a group scope collects into (``artery.TrajectoryGroup``)."""

    trajectories: list[Any]
    exceptions: list[TrajectoryException]


_group: contextvars.ContextVar[Collector | None] = contextvars.ContextVar("artery_group_scope", default=None)

#: Each open group scope's tokens, by the group's id (as ``scope`` keeps the trajectories').
_tokens: dict[int, list[contextvars.Token[Collector | None]]] = {}

#: The exceptions each group recorded, the objects themselves: a rollout's exception ends both
#: its own scope and the one ``trajectory_group`` runs it in, and is one failure, recorded once.
_recorded: weakref.WeakKeyDictionary[Any, list[BaseException]] = weakref.WeakKeyDictionary()


def exception_record(exc: BaseException) -> TrajectoryException:
    return TrajectoryException(
        type=type(exc).__name__,
        message=str(exc),
        traceback="".join(traceback.format_exception(exc))[-8000:],
    )


def current_group() -> Collector | None:
    """The innermost group scope around this call; ``None`` outside one."""
    return _group.get()


def enter(group: Collector) -> None:
    _tokens.setdefault(id(group), []).append(_group.set(group))


def leave(group: Collector) -> None:
    tokens = _tokens[id(group)]
    token = tokens.pop()
    if not tokens:
        del _tokens[id(group)]
    _group.reset(token)


def trajectory_ended(trajectory: Any) -> None:
    """A trajectory finished here: the innermost group keeps it (once)."""
    group = _group.get()
    if group is None:
        return
    with scope.record_lock:  # scopes end in threads too
        if all(kept is not trajectory for kept in group.trajectories):
            group.trajectories.append(trajectory)


def rollout_failed(exc: BaseException) -> None:
    """A trajectory's scope ended by an exception: the innermost group records it (once)."""
    group = _group.get()
    if group is None:
        return
    with scope.record_lock:
        seen = _recorded.setdefault(group, [])
        if any(known is exc for known in seen):
            return
        seen.append(exc)
        group.exceptions.append(exception_record(exc))
