"""The pause gate of one inference replica: admission, draining and pause leases.

Pure asyncio, no NATS: ``control.py`` feeds it the trainer's requests, the HTTP layer wraps every
generation in ``admit()``.

Lease rules (the point of this module is that inference is never paused longer than a lease):
- The gate is paused while it holds at least one unexpired lease. Each lease has its own expiry;
  a pause with a lease id already held is a renewal and sets that lease's expiry to
  ``now + lease_seconds``. A pause with another lease id adds a second lease: the gate stays
  paused until every lease is released or expired. (Two pausers — a restarted trainer whose
  predecessor's lease is still running, or a trainer and an evaluation job — then cannot resume
  each other's pause early, and none of them can extend another's.)
- ``resume(lease_id)`` releases that lease; releasing one the gate does not hold is a no-op.
- Expiry needs no caller: a timer drops expired leases and resumes when none is left.
- Requests that arrive while paused wait (they are not dropped) up to ``max_wait_s``, then fail
  with ``EnginePaused``; requests already in flight when a pause arrives run to completion.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from artery.services.inference.serving import EnginePaused
from artery.shared.logs import get_logger

log = get_logger(__name__)

#: ``on_pause`` frees accelerator memory (engine.sleep) and says whether anything was freed;
#: ``on_resume`` brings the engine back (engine.wake) before requests are admitted again.
PauseHook = Callable[[], Awaitable[bool | None]]
ResumeHook = Callable[[], Awaitable[None]]


__all__ = ["EnginePaused", "PauseGate", "PauseResult"]  # EnginePaused: the HTTP layer's (503)


@dataclass(frozen=True)
class PauseResult:
    #: Whether the gate is paused (holds a lease) when the pause call returns.
    paused: bool
    lease_id: str
    #: Wall-clock end of this lease (what the trainer must renew before).
    lease_expires_at: dt.datetime
    #: Requests that were in flight when the pause arrived and finished before it returned.
    drained: int
    #: Requests still running when ``drain_timeout_s`` ran out (the engine was not put to sleep).
    still_running: int
    #: Whether accelerator memory is released (``on_pause`` ran and reported it freed memory).
    freed_memory: bool
    #: Whether this call renewed a lease the gate already held.
    renewed: bool


class PauseGate:
    def __init__(
        self,
        *,
        max_wait_s: float = 300.0,
        on_pause: PauseHook | None = None,
        on_resume: ResumeHook | None = None,
    ):
        self.max_wait_s = max_wait_s
        self.on_pause = on_pause
        self.on_resume = on_resume
        self._leases: dict[str, float] = {}  # lease id -> expiry on the loop's monotonic clock
        self._admitting = asyncio.Event()
        self._admitting.set()
        self._idle = asyncio.Event()  # set while nothing is in flight
        self._idle.set()
        self._in_flight = 0
        self._waiting = 0
        self._asleep = False  # on_pause ran; on_resume is owed before admitting again
        self._freed = False
        # Serialises transitions, so a hook (engine sleep/wake) never runs twice concurrently.
        self._lock = asyncio.Lock()
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task] = set()

    # -- what the service and the registry read -------------------------------------------------

    @property
    def paused(self) -> bool:
        return bool(self._leases)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def waiting(self) -> int:
        """Requests parked at the gate, waiting for the pause to end."""
        return self._waiting

    @property
    def lease_ids(self) -> list[str]:
        return list(self._leases)

    def lease_expires_at(self, lease_id: str) -> dt.datetime | None:
        expiry = self._leases.get(lease_id)
        if expiry is None:
            return None
        remaining = max(0.0, expiry - asyncio.get_running_loop().time())
        return dt.datetime.now(dt.UTC) + dt.timedelta(seconds=remaining)

    def _seconds_left(self) -> float | None:
        """Until the last lease ends at the latest (a renewal may push it further)."""
        if not self._leases:
            return None
        return max(0.0, max(self._leases.values()) - asyncio.get_running_loop().time())

    def governing_lease(self) -> str | None:
        """The lease that expires last: the one that decides when the pause ends at the latest."""
        return max(self._leases, key=self._leases.__getitem__) if self._leases else None

    # -- requests --------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def admit(self, max_wait_s: float | None = None) -> AsyncIterator[None]:
        """Hold one request's place: wait while paused, count it in flight until it is done."""
        limit = self.max_wait_s if max_wait_s is None else max_wait_s
        if not self._admitting.is_set():
            loop = asyncio.get_running_loop()
            deadline = loop.time() + limit
            self._waiting += 1
            try:
                # A loop, not one wait: a new pause may close the gate again before we run.
                while not self._admitting.is_set():
                    remaining = deadline - loop.time()
                    if remaining <= 0:
                        raise EnginePaused(
                            f"inference is paused for training; waited {limit:.1f}s",
                            retry_after=self._seconds_left(),
                        )
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._admitting.wait(), remaining)
            finally:
                self._waiting -= 1
        # No await between the check above and this increment: a pause cannot slip in between.
        self._in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()

    # -- the trainer's side ----------------------------------------------------------------------

    async def pause(
        self,
        lease_id: str,
        lease_seconds: float,
        *,
        drain_timeout_s: float = 60.0,
        free_memory: bool = True,
    ) -> PauseResult:
        """Take or renew ``lease_id``, stop admitting, drain what is in flight, then free memory.

        Returns once nothing is in flight or ``drain_timeout_s`` ran out. The engine is put to
        sleep (``on_pause``) only after a full drain: sleeping under a running request would
        break it. A later renewal retries the drain and the sleep.
        """
        if lease_seconds <= 0:
            raise ValueError("lease_seconds must be positive")
        loop = asyncio.get_running_loop()
        async with self._lock:
            renewed = lease_id in self._leases
            if not self._leases:
                log.info("inference paused", lease_id=lease_id, lease_seconds=lease_seconds)
            self._leases[lease_id] = loop.time() + lease_seconds
            self._admitting.clear()
            self._schedule_expiry()
        running_at_start = self._in_flight
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), drain_timeout_s)
        still_running = self._in_flight
        async with self._lock:
            held = lease_id in self._leases  # it may have been released or expired meanwhile
            if held and still_running == 0 and free_memory and not self._asleep:
                self._asleep = True  # set first: a failing hook still gets its on_resume
                if self.on_pause is not None:
                    try:
                        self._freed = bool(await self.on_pause())
                    except Exception as exc:  # the pause holds; only the memory stays in use
                        log.error("on_pause hook failed", error=repr(exc))
            if still_running:
                log.warning("drain timed out", lease_id=lease_id, still_running=still_running)
            expires_at = self.lease_expires_at(lease_id) or dt.datetime.now(dt.UTC)
            return PauseResult(
                paused=held,
                lease_id=lease_id,
                lease_expires_at=expires_at,
                drained=max(0, running_at_start - still_running),
                still_running=still_running,
                freed_memory=held and self._freed,
                renewed=renewed,
            )

    async def resume(self, lease_id: str) -> bool:
        """Release ``lease_id``; True when the gate admits requests afterwards."""
        async with self._lock:
            if self._leases.pop(lease_id, None) is not None:
                log.info("lease released", lease_id=lease_id, remaining=len(self._leases))
                if self._leases:
                    self._schedule_expiry()
                else:
                    await self._open()
            return not self._leases

    async def close(self) -> None:
        """Stop the timer and release every lease (the replica is shutting down)."""
        async with self._lock:
            self._leases.clear()
            await self._open()

    # -- internals ---------------------------------------------------------------------------------

    async def _open(self) -> None:
        """Wake the engine, then admit: a request must never reach a sleeping engine."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._asleep:
            self._asleep = False
            self._freed = False
            if self.on_resume is not None:
                try:
                    await self.on_resume()
                except Exception as exc:
                    # Admitting anyway: requests failing on a broken engine are visible and
                    # retried by clients; a gate that never opens is the hang this module prevents.
                    log.error("on_resume hook failed; admitting anyway", error=repr(exc))
        if not self._admitting.is_set():
            log.info("inference resumed")
        self._admitting.set()

    def _schedule_expiry(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._leases:
            self._timer = asyncio.get_running_loop().call_at(min(self._leases.values()), self._on_timer)

    def _on_timer(self) -> None:
        # A plain callback cannot await; the task it starts is never cancelled halfway through a
        # hook, since rescheduling cancels only the timer handle.
        self._timer = None
        task = asyncio.get_running_loop().create_task(self._expire())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _expire(self) -> None:
        async with self._lock:
            # The loop may fire a timer up to its clock resolution early; a millisecond of slack
            # avoids re-arming for a lease that is, for all purposes, over.
            now = asyncio.get_running_loop().time() + 1e-3
            for lease_id, expiry in list(self._leases.items()):
                if expiry <= now:
                    del self._leases[lease_id]
                    log.warning("lease expired; no renewal arrived", lease_id=lease_id)
            if self._leases:
                self._schedule_expiry()
            else:
                await self._open()
