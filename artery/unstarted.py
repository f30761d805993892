"""Closing rollouts that were created but never started, so none is left "never awaited".

A rollout coroutine exists from the moment the agent's generator yields it (``TrajectoryGroup(
rollout() for _ in range(8))`` builds all eight at once). When the group, the batch or the gather
around it ends early — too many exceptions, a batch skipped, a cancellation — some of them never
ran. Left to the garbage collector, each would warn "coroutine ... was never awaited" at some
unrelated later moment (Python 3.11 can even fail a ``compile()`` that the collector interrupts
there); closed here, they end quietly at once.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable


def close_unstarted(awaitables: Iterable[object]) -> None:
    """Close each coroutine of ``awaitables`` that never started; leave the others alone. An
    awaitable that holds rollouts of its own (a pending group) closes those it never started."""
    for item in awaitables:
        if inspect.iscoroutine(item):
            if inspect.getcoroutinestate(item) == inspect.CORO_CREATED:
                item.close()
        else:
            close = getattr(item, "close_unstarted", None)
            if callable(close):
                close()
