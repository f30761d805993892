"""Giving a CPU step's freed heap back to the operating system, once the trainer is idle."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

#: How long a trainer goes without a step before the heap its steps freed goes back to the OS.
IDLE_RELEASE_S = 30.0


def release_freed_memory() -> None:
    """Give the heap memory that a step freed back to the OS (glibc's ``malloc_trim``, every arena;
    elsewhere a no-op).

    glibc serves a CPU step's activations (blocks of megabytes) from its arenas once frees have
    raised its mmap threshold, and keeps them for reuse, in an arena per thread (the trainer's
    steps share one thread, ``torch_thread.py``; a test or a script may take steps on others), so
    without a trim a trainer holds gigabytes of freed activations between steps
    (``loadtests/trainer_memory.py`` measures how many). The next step faults back in what a trim
    gave away, which is why steps trim through ``IdleHeapRelease`` rather than after each one.
    """
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


class IdleHeapRelease:
    """``release_freed_memory`` once no step has run for ``idle_s`` seconds.

    Released after every step, a step's freed activations had to come back in the next step, page
    by page (a minor fault and a zeroed page each), while training ran back to back. Released once
    the trainer is idle, back-to-back steps reuse them and an idle trainer still gives them back.
    The heap is the process's, so one instance serves every policy of a process (``freed_heap``).
    """

    def __init__(
        self, idle_s: float = IDLE_RELEASE_S, release: Callable[[], None] = release_freed_memory
    ) -> None:
        self._idle_s = idle_s
        self._release = release
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None

    def busy(self) -> None:
        """A step starts: nothing is released until it has ended and ``idle_s`` have passed."""
        with self._lock:
            self._cancel()

    def idle(self) -> None:
        """A step has ended: release in ``idle_s`` seconds, unless another step starts first."""
        with self._lock:
            self._cancel()
            # A timer thread, not the event loop: the policy lives on the trainer's torch thread
            # and in scripts with no loop at all. A release that races a starting step only costs
            # that step its page faults.
            self._timer = threading.Timer(self._idle_s, self._release)
            self._timer.daemon = True
            self._timer.start()

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Busy for the block, idle after it, however it ends."""
        self.busy()
        try:
            yield
        finally:
            self.idle()

    def pending(self) -> bool:
        """Whether a release is waiting for the idle time to pass."""
        with self._lock:
            return self._timer is not None and self._timer.is_alive()

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


#: The process's freed heap: ``Policy`` marks its CPU steps busy and idle on it.
freed_heap = IdleHeapRelease()


@functools.cache
def _libc() -> Any:
    """glibc through ctypes, when this process runs on it; else None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None
