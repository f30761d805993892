"""Load each published adapter into the engine, newest first for a replica that starts late.

The watcher follows ``checkpoint.published`` and ``checkpoint.deleted`` of its project/model
through plain NATS subscriptions (the stream's messages are delivered to subscribers as they are
stored), and reads the last published event with a direct get at start and every
``catch_up_s``: a fresh replica loads the newest adapter at once (not every step ever trained),
and one that was disconnected while a step was published catches up. Deletions missed while
disconnected leave an old adapter loaded until the replica restarts; nothing else is lost.

No JetStream consumer: creating one on ARTERY_CHECKPOINTS (an unnamed ordered consumer names
itself in the request body) is a permission with which a replica could change the publisher's
durable consumer; a direct get names its subject, so inference may read this one subject only.

For each event: fetch the archive from the Object Store, verify the announced sha256 (a
mismatch is logged and skipped, nothing is loaded), unpack it into the local cache, load it as
``<model>@<step>`` and tell the serving state through ``on_loaded(step, served_name)``. The
callback sees every load in order and decides what the bare ``<model>`` name points at (the
highest step, normally; an old step republished to be "served again" arrives later but lower).

Each load runs in an ``inference.load_adapter`` span (``inference.unload_adapter`` for a
deletion) that continues the trace the event's headers carry: the publisher's, hence the
trainer's step and the ``train()`` call that asked for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import shutil
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from opentelemetry import trace

from artery.schemas import CheckpointDeleted, CheckpointPublished
from artery.services.inference.engine.base import Engine
from artery.shared import subjects
from artery.shared.adapters import AdapterError, AdapterNotFound, get_adapter, unpack_adapter
from artery.shared.bus import CONTENT_TYPE
from artery.shared.codec import EventDecoder
from artery.shared.errors import InvalidMessage
from artery.shared.logs import get_logger
from artery.shared.tracing import continue_trace, tracer

log = get_logger(__name__)

OnLoaded = Callable[[int, str], Awaitable[None] | None]
_decoder = EventDecoder(CheckpointPublished)
_deleted_decoder = EventDecoder(CheckpointDeleted)
_tracer = tracer("inference")
_FIRST_CATCH_UP_ATTEMPTS = 25


@dataclass(frozen=True)
class _Delivery:
    """A checkpoint event as received, live or by a catch-up."""

    subject: str
    data: bytes
    headers: dict[str, str] | None


def served_name(model: str, step: int) -> str:
    return f"{model}@{step}"


class CheckpointWatcher:
    def __init__(
        self,
        js: JetStreamContext,
        project: str,
        model: str,
        engine: Engine,
        on_loaded: OnLoaded,
        *,
        cache_dir: str | Path,
        fetch_attempts: int = 3,
        retry_delay_s: float = 1.0,
        catch_up_s: float = 10.0,
    ):
        self.js = js
        self.project = project
        self.model = model
        self.engine = engine
        self.on_loaded = on_loaded
        self.cache_dir = Path(cache_dir) / project / model
        self.fetch_attempts = fetch_attempts
        self.retry_delay_s = retry_delay_s
        self.catch_up_s = catch_up_s
        #: served name -> sha256 of what is loaded under it (a redelivery is not loaded twice).
        self.loaded: dict[str, str] = {}
        #: served name -> sha256 of the last published event handled, loaded or refused: what a
        #: catch-up finds again is not handled again.
        self._handled: dict[str, str] = {}
        self._published = subjects.checkpoint("published", project, model)
        self._deleted = subjects.checkpoint("deleted", project, model)
        self._queue: asyncio.Queue[_Delivery] = asyncio.Queue()
        self._subs: list = []
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        nc = self.js._nc  # the client the context was made from
        # The callbacks only enqueue: loading takes seconds, and one slow callback would hold up
        # every other subscription of the connection.
        for subject in (self._published, self._deleted):
            self._subs.append(await nc.subscribe(subject, cb=self._enqueue))
        # After subscribing: an event published in between is read twice, and loaded once.
        await self._first_catch_up()
        self._tasks = [asyncio.create_task(self._run()), asyncio.create_task(self._keep_catching_up())]

    async def stop(self) -> None:
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._subs = []
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []

    async def _enqueue(self, msg) -> None:
        self._queue.put_nowait(_Delivery(msg.subject, msg.data, msg.headers))

    async def _first_catch_up(self) -> None:
        """The newest adapter at once; a stream provisioned a moment ago may not answer direct
        gets for a little while, and then the periodic catch-up finds it."""
        for attempt in range(_FIRST_CATCH_UP_ATTEMPTS):
            try:
                await self._catch_up()
                return
            except (NoRespondersError, NatsTimeoutError) as exc:
                if attempt + 1 == _FIRST_CATCH_UP_ATTEMPTS:
                    log.warning("no last checkpoint read at start; catching up later", error=repr(exc))
                    return
                await asyncio.sleep(0.2)

    async def _catch_up(self) -> None:
        """Queue the last published event, unless it was handled already."""
        try:
            last = await self.js.get_last_msg(subjects.CHECKPOINTS.name, self._published, direct=True)
        except NotFoundError:
            return  # nothing published yet
        try:
            event = _decoder.decode(last.data, (last.headers or {}).get(CONTENT_TYPE))
        except InvalidMessage:
            return  # _run logs it when it arrives live
        if event.step is not None and self._handled.get(served_name(self.model, event.step)) == event.sha256:
            return
        self._queue.put_nowait(_Delivery(self._published, last.data, last.headers))

    async def _keep_catching_up(self) -> None:
        while True:
            await asyncio.sleep(self.catch_up_s)
            try:
                await self._catch_up()
            except Exception as exc:  # NATS away: the next round tries again
                log.warning("checkpoint catch-up failed", error=repr(exc))

    async def _run(self) -> None:
        while True:
            delivery = await self._queue.get()
            deleted = delivery.subject == self._deleted
            content_type = (delivery.headers or {}).get(CONTENT_TYPE)
            try:
                with continue_trace(
                    _tracer,
                    "inference.unload_adapter" if deleted else "inference.load_adapter",
                    delivery.headers,
                    attributes={"artery.project": self.project, "artery.model": self.model},
                ):
                    if deleted:
                        await self.handle_deleted(delivery.data, content_type)
                    else:
                        await self.handle(delivery.data, content_type)
            except Exception:  # one bad checkpoint must not stop the replica following the next
                log.exception("checkpoint handling failed", subject=delivery.subject)

    async def handle_deleted(self, data: bytes, content_type: str | None = None) -> str | None:
        """Process one ``checkpoint.deleted``: unload that step; the served name when it was loaded."""
        try:
            event = _deleted_decoder.decode(data, content_type)
        except InvalidMessage as exc:
            log.error("unreadable checkpoint.deleted; skipped", error=str(exc))
            return None
        if event.step is None:
            return None
        name = served_name(self.model, event.step)
        if name not in self.loaded:
            return None
        await self.engine.unload_adapter(name)
        del self.loaded[name]
        await asyncio.to_thread(shutil.rmtree, self.cache_dir / f"step-{event.step}", True)
        log.info("adapter unloaded", served_name=name, reason=event.reason)
        return name

    async def handle(self, data: bytes, content_type: str | None = None) -> str | None:
        """Process one ``checkpoint.published``; the served name when it was loaded, else None."""
        try:
            event = _decoder.decode(data, content_type)
        except InvalidMessage as exc:
            log.error("unreadable checkpoint.published; skipped", error=str(exc))
            return None
        if event.step is None:
            log.error("checkpoint.published without a step; skipped", object_name=event.object_name)
            return None
        name = served_name(self.model, event.step)
        span = trace.get_current_span()
        span.set_attribute("artery.step", event.step)
        span.set_attribute("artery.served_name", name)
        if event.served_name != name:
            log.warning(
                "served_name differs from <model>@<step>; using the latter", announced=event.served_name
            )
        self._handled[name] = event.sha256
        if self.loaded.get(name) == event.sha256:
            span.set_attribute("artery.already_loaded", True)
            return name  # the same adapter again (read live and by a catch-up)
        archive = await self._fetch(event.object_name)
        if archive is None:
            return None
        try:
            path = await asyncio.to_thread(
                unpack_adapter, archive, self.cache_dir / f"step-{event.step}", event.sha256
            )
        except AdapterError as exc:
            log.error("adapter refused; not loaded", served_name=name, error=str(exc))
            return None
        if name in self.loaded:  # a step re-published with other bytes: replace what is served
            with contextlib.suppress(Exception):
                await self.engine.unload_adapter(name)
        await self.engine.load_adapter(name, path)
        self.loaded[name] = event.sha256
        log.info("adapter loaded", served_name=name, sha256=event.sha256)
        result = self.on_loaded(event.step, name)
        if inspect.isawaitable(result):
            await result
        return name

    async def _fetch(self, object_name: str) -> bytes | None:
        for attempt in range(1, self.fetch_attempts + 1):
            try:
                return await get_adapter(self.js, object_name)
            except AdapterNotFound as exc:  # retention removed it, or it never arrived
                log.error("adapter not in the object store; skipped", error=str(exc))
                return None
            except AdapterError as exc:
                log.error("adapter refused; skipped", error=str(exc))
                return None
            except Exception as exc:  # a NATS hiccup: try again shortly
                log.warning("adapter fetch failed", object_name=object_name, attempt=attempt, error=repr(exc))
                if attempt < self.fetch_attempts:
                    await asyncio.sleep(self.retry_delay_s * attempt)
        return None
