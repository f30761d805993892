"""Which trajectory records the exchanges made here: a context variable, so a scope follows a
rollout into the tasks and threads (``asyncio.to_thread``) it starts, and no further."""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

from artery.capture.exchanges import Exchange, Kind


class Recorder(Protocol):
    """What a scope records into (``artery.Trajectory``)."""

    def record_exchange(self, kind: Kind, exchange: Exchange) -> None: ...


_recorder: contextvars.ContextVar[Recorder | None] = contextvars.ContextVar(
    "artery_capture_scope", default=None
)

#: Exchanges end in tasks and threads of their own: one lock keeps their appends in order.
record_lock = threading.Lock()


def current_recorder() -> Recorder | None:
    """The innermost scope's trajectory; ``None`` outside a scope or under ``no_capture``."""
    return _recorder.get()


#: Each open scope's tokens, by the recorder's id: kept here, not on the trajectory, which is a
#: dataclass whose fields are all ART's (and are dumped and copied).
_tokens: dict[int, list[contextvars.Token[Recorder | None]]] = {}


def enter(recorder: Recorder) -> None:
    _tokens.setdefault(id(recorder), []).append(_recorder.set(recorder))


def leave(recorder: Recorder) -> None:
    tokens = _tokens[id(recorder)]
    token = tokens.pop()
    if not tokens:
        del _tokens[id(recorder)]
    _recorder.reset(token)


@contextmanager
def no_capture() -> Iterator[None]:
    """The enclosing scopes are hidden inside: their trajectories record nothing made here (a
    judge's calls, a tool's own model calls); a scope opened inside records as any other."""
    token = _recorder.set(None)
    try:
        yield
    finally:
        _recorder.reset(token)
