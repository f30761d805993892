"""Which adapters running requests still use, so that an adapter is removed only once its last
request has finished.

vLLM keeps a LoRA adapter by its path and reads the directory again whenever a scheduled request
needs the adapter back in a LoRA slot. Removing an adapter (and its files) while a request still
generates with it therefore made vLLM's worker fail to open the file, and that killed the whole
engine: every model the replica served. Retention deletes steps that way in asynchronous
training every step, since the rollouts one step behind are still running.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable, Iterator
from contextlib import contextmanager


class AdapterUsers:
    """Counts the running requests of each adapter; ``finished(key)`` waits for them to end."""

    def __init__(self) -> None:
        self._running: dict[Hashable, int] = {}
        # Set (and dropped) when an adapter's last running request ends: what ``finished`` awaits.
        self._idle: dict[Hashable, asyncio.Event] = {}

    @contextmanager
    def using(self, key: Hashable | None) -> Iterator[None]:
        """Around one request's generation; ``None`` (no adapter) is not counted."""
        if key is None:
            yield
            return
        running = self._running.get(key, 0)
        self._running[key] = running + 1
        if not running:  # the first request since the adapter was last idle
            self._idle[key] = asyncio.Event()
        try:
            yield
        finally:
            self._running[key] -= 1
            if not self._running[key]:
                del self._running[key]
                self._idle.pop(key).set()

    def running(self, key: Hashable) -> int:
        return self._running.get(key, 0)

    async def finished(self, key: Hashable) -> None:
        """Returns once no request uses ``key``; the caller has already stopped new ones."""
        idle = self._idle.get(key)
        if idle is not None:
            await idle.wait()
