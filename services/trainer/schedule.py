"""Which pending train request runs next, and what happens to the others meanwhile.

One trainer trains one request at a time for every project, so the order is the fairness: the
trainer fetches up to ``schedule_window`` pending requests, and of those whose groups are all
stored it runs the one whose project was served least recently (round-robin over projects; within
a project, the oldest). A project that queues fifty requests therefore gets every other step when
another project waits, not the next fifty.

A request whose groups are not stored yet never occupies the trainer: it is handed back to
JetStream with a delay (``Deferred``) and looked at again later, up to ``group_wait_s`` after it
was published; the requests that were ready but not picked are handed back at once (``Later``).
Both are settled before the picked request trains, so none of them sits unacknowledged for the
length of a step. Neither counts as a failure of the message (the consumer's poison count is for
errors, not waits).

JetStream hands redeliveries out before new messages, so a project's flood handed back at once
would fill every window and hide the requests behind it. Handed-back requests of one project are
therefore spread out: its first two ready ones come back at once (the trainer never idles), the
rest one ``LATER_SPACING_S`` apart; its n-th waiting one stays away n times as long as one alone
would. A flood then costs its own project time, and the window keeps reaching newer requests.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from nats.aio.msg import Msg

from artery.shared.consumer import DurableConsumer
from artery.shared.metrics import MESSAGES

#: A deferred request is looked at again after at least this long (its groups may land any moment:
#: the SDK publishes them just before the request), and at most GROUP_RECHECK_S.
FIRST_RECHECK_S = 0.1
GROUP_RECHECK_S = 2.0
#: Ready requests of one project handed back at once; the later ones come back this far apart.
READY_AT_ONCE = 2
LATER_SPACING_S = 1.0


class Deferred(Exception):
    """Not now: nak with ``delay_s``; not an error, never dead-lettered."""

    def __init__(self, reason: str, delay_s: float) -> None:
        super().__init__(reason)
        self.delay_s = delay_s


class Later(Deferred):
    """Ready, but another request was picked: back to the queue, at once for a project's first
    ``READY_AT_ONCE``, spaced out after them (``rank``: 0 for its first handed back)."""

    def __init__(self, rank: int = 0) -> None:
        super().__init__("another request runs first", max(0, rank - READY_AT_ONCE + 1) * LATER_SPACING_S)


class Settled(Exception):
    """Already acknowledged, nakked or dead-lettered by the handler: nothing left to do."""


def recheck_delay(age_s: float, wait_s: float, rank: int = 0) -> float:
    """How long a request waiting for its groups stays away: short at first, growing with its age,
    times its rank among its project's waiting requests (1 for the first), and never past the end
    of its wait (``wait_s`` after it was published), when it is answered."""
    alone = min(max(age_s / 4, FIRST_RECHECK_S), GROUP_RECHECK_S)
    return min(alone * (rank + 1), max(wait_s - age_s, FIRST_RECHECK_S))


@dataclass
class RoundRobin:
    """Projects in the order they were last served: the least recently served goes first."""

    _served: dict[str, int]
    _clock: itertools.count

    def __init__(self) -> None:
        self._served = {}
        self._clock = itertools.count(1)

    def pick(self, projects: Sequence[str]) -> int:
        """The index of the entry to run: its project served least recently (never: first), the
        earliest entry of that project (entries are in stream order)."""
        return min(range(len(projects)), key=lambda i: (self._served.get(projects[i], 0), i))

    def served(self, project: str) -> None:
        self._served[project] = next(self._clock)


class DeferringConsumer(DurableConsumer):
    """A durable consumer that also understands ``Deferred`` and ``Settled`` outcomes."""

    async def _settle(self, msg: Msg, outcome: BaseException | None) -> None:
        if isinstance(outcome, Settled):
            return
        if isinstance(outcome, Deferred):
            await msg.nak(delay=outcome.delay_s or None)
            MESSAGES.labels(self.service, self.durable, "deferred").inc()
            return
        await super()._settle(msg, outcome)

    async def settle_now(self, msg: Msg, outcome: BaseException | None) -> Settled:
        """Settle ``msg`` before the batch's handler returns; the outcome to return for it."""
        await self._settle(msg, outcome)
        return Settled()
