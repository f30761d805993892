"""ART's ``yield_trajectory`` / ``capture_yielded_trajectory``: a trajectory handed out of a
coroutine that returns something else (or nothing).

``await capture_yielded_trajectory(agent(...))`` runs the coroutine and returns the trajectory it
last passed to ``yield_trajectory(...)``; a ``RuntimeError`` when it passed none. Outside a
capture, ``yield_trajectory`` does nothing.
"""

from __future__ import annotations

import contextvars
from collections.abc import Coroutine
from typing import Any

from artery.trajectories import Trajectory

__all__ = ["capture_yielded_trajectory", "yield_trajectory"]


class _Capture:
    def __init__(self) -> None:
        self.trajectory: Trajectory | None = None


_context: contextvars.ContextVar[_Capture | None] = contextvars.ContextVar(
    "artery_yield_trajectory", default=None
)


def yield_trajectory(trajectory: Trajectory) -> None:
    """Hand ``trajectory`` to the enclosing ``capture_yielded_trajectory`` (the last one wins)."""
    context = _context.get()
    if context is not None:
        context.trajectory = trajectory


async def capture_yielded_trajectory(coroutine: Coroutine[Any, Any, Any]) -> Trajectory:
    """Run ``coroutine`` and return the trajectory it yielded."""
    context = _Capture()
    token = _context.set(context)
    try:
        await coroutine
    finally:
        _context.reset(token)
    if context.trajectory is None:
        raise RuntimeError("No trajectory yielded")
    return context.trajectory
