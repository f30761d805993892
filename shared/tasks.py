"""Ending background tasks without losing the caller's own cancellation.

The usual way to stop a helper task, ``task.cancel()`` then ``await task`` under
``suppress(CancelledError)``, cannot tell the helper's cancellation (expected) from the caller's
(a service stopping, a step abandoned): when the caller is cancelled while it waits, asyncio
cancels the awaited helper too, the caller receives a ``CancelledError``, and the ``suppress``
swallows it. The caller then goes on as if nothing had asked it to stop.

``cancel_and_wait`` tells them apart by the caller's count of pending cancellations
(``Task.cancelling``): a new one while waiting is the caller's and is raised. One that was
already pending when the wait began is not counted again, so cleanup in a ``finally`` that runs
because the caller is being cancelled still finishes.
"""

from __future__ import annotations

import asyncio
from typing import Any


async def cancel_and_wait(task: asyncio.Future[Any]) -> None:
    """Cancel ``task`` and wait until it has ended. Its own cancellation is absorbed and any other
    exception it ends with is raised; a cancellation of the caller during the wait is raised."""
    caller = asyncio.current_task()
    pending = caller.cancelling() if caller is not None else 0
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        if caller is not None and caller.cancelling() > pending:
            raise


async def settled(future: asyncio.Future[Any]) -> BaseException | None:
    """Wait until ``future`` has ended and return its exception (None if it succeeded or was
    cancelled), for work that cannot be stopped (a thread) while another error is on its way: the
    work is over before the caller moves on, and its outcome is read, so asyncio never reports it
    as "never retrieved". A cancellation of the caller during the wait is raised."""
    await asyncio.wait([future])
    return None if future.cancelled() else future.exception()
