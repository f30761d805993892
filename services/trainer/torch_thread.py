"""One thread for a trainer's torch work: loading a policy, a step, taking the step in memory.

``asyncio.to_thread`` hands each call to whichever thread of the loop's default executor is free,
so successive steps run on different threads, and anything else in that executor (hashing an
adapter, writing a step to disk) can run beside a step on a thread that ran one before. Each
thread that enters torch's OpenMP parallel regions gets a team of OpenMP workers of its own, and
each thread gets a glibc arena of its own (``memory.py``): two teams sized for every core take
turns on the same cores, and a step's freed activations stay resident once per thread.

All of one trainer's torch work therefore runs on one thread, in order: one team, one arena,
and never two calls on a policy at once. Work that touches no tensors (disk, tar, hashing) stays
on the default executor, beside it.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


class TorchThread:
    """A single worker thread, started on the first call and ended by ``close``."""

    def __init__(self, name: str = "artery-trainer-torch") -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def run(self, fn: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs) -> R:
        """``fn(*args, **kwargs)`` on the thread, after the work queued before it; the caller's
        context (its trace span) goes with it, as with ``asyncio.to_thread``. A cancelled caller
        stops waiting; the call, once started, runs to its end, as a thread's does."""
        call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._executor, call)

    def close(self) -> None:
        """End the thread once the work queued on it is done; later calls are refused."""
        self._executor.shutdown(wait=False)
