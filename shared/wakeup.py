"""Waiting on events instead of timers: wake when a message arrives on any of some subjects.

A waiter that would otherwise poll (is the group stored? is the step served?) subscribes first,
then loops: ``clear()``, check, ``wait(timeout)``. A message that arrives during the check is not
lost (it sets the flag after the clear), and the timeout is only the safety net for a message
missed while reconnecting, never the pace of the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import nats


class Wakeup:
    def __init__(self) -> None:
        self._event = asyncio.Event()

    def clear(self) -> None:
        self._event.clear()

    def set(self) -> None:
        self._event.set()

    async def wait(self, timeout_s: float) -> bool:
        """True when woken by a message, False when ``timeout_s`` passed first."""
        try:
            await asyncio.wait_for(self._event.wait(), max(timeout_s, 0.0))
        except TimeoutError:
            return False
        return True


@contextlib.asynccontextmanager
async def woken_by(nc: nats.NATS, *subjects: str) -> AsyncIterator[Wakeup]:
    """A ``Wakeup`` set by every message on ``subjects`` while the block runs."""
    wakeup = Wakeup()

    async def on_message(_msg) -> None:
        wakeup.set()

    subs = [await nc.subscribe(subject, cb=on_message) for subject in subjects]
    # The server must have the subscriptions before the caller's first check: a message sent
    # between that check and a SUB still in our write buffer would be missed (a 2 s stall).
    await nc.flush()
    try:
        yield wakeup
    finally:
        for sub in subs:
            with contextlib.suppress(Exception):  # a closed connection has dropped it already
                await sub.unsubscribe()
