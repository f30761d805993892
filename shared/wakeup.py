"""Waiting on events instead of timers: wake when a message arrives on any of some subjects.

A waiter that would otherwise poll (is the group stored? is the step served?) subscribes first,
then loops: ``clear()``, check, ``wait(timeout)``. A message that arrives during the check is not
lost (it sets the flag after the clear), and the timeout is only the safety net for a message
missed while reconnecting, never the pace of the loop.

When the safety net does fire and the recheck then finds the condition true, a wake-up was
missed: the waiter calls ``satisfied()`` on success and that is counted, per waiter, in
``artery_wakeup_fallbacks_total`` and in ``fallbacks_fired()`` (what the loop benchmark reads).
A timeout after which the condition is still false is a plain wait, not a fallback.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator

import nats
from nats.aio.msg import Msg
from prometheus_client import Counter

FALLBACKS = Counter(
    "artery_wakeup_fallbacks",
    "event-driven waits that ended on the safety-net timeout with the condition already true",
    ["waiter"],
)
# The same count in this process, without a Prometheus registry walk (benchmarks, tests).
_fired: collections.Counter[str] = collections.Counter()


def fallbacks_fired() -> dict[str, int]:
    """Missed wake-ups so far in this process, by waiter."""
    return dict(_fired)


class Wakeup:
    def __init__(self, waiter: str = "unnamed") -> None:
        self.waiter = waiter
        self._event = asyncio.Event()
        self._timed_out = False
        # The newest message of each subject heard: a waiter can read the news itself, where
        # reading the store right after the wake-up may not show it yet (a stream stores
        # after plain subscribers are served).
        self.latest: dict[str, Msg] = {}

    def clear(self) -> None:
        self._event.clear()

    def set(self) -> None:
        self._event.set()

    def heard(self, msg: Msg) -> None:
        self.latest[msg.subject] = msg
        self._event.set()

    async def wait(self, timeout_s: float) -> bool:
        """True when woken by a message, False when ``timeout_s`` passed first."""
        try:
            await asyncio.wait_for(self._event.wait(), max(timeout_s, 0.0))
        except TimeoutError:
            self._timed_out = True
            return False
        self._timed_out = False
        return True

    def satisfied(self) -> None:
        """The awaited condition held at this check; counted as a fallback when the check ran
        because the timeout passed rather than because a message came."""
        if self._timed_out:
            FALLBACKS.labels(self.waiter).inc()
            _fired[self.waiter] += 1
            self._timed_out = False


@contextlib.asynccontextmanager
async def woken_by(nc: nats.NATS, *subjects: str, waiter: str = "unnamed") -> AsyncIterator[Wakeup]:
    """A ``Wakeup`` set by every message on ``subjects`` while the block runs."""
    wakeup = Wakeup(waiter)

    async def on_message(msg: Msg) -> None:
        wakeup.heard(msg)

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
