"""Load each published adapter into the engine, newest first for a replica that starts late.

The watcher reads ``checkpoint.published`` for its project/model through an ephemeral ordered
JetStream consumer that starts at the last message of the subject: a fresh replica loads the
newest adapter at once (not every step ever trained), then follows live. Ordered consumers
need no acks and re-create themselves after a gap, which suits a read-only follower.

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
from pathlib import Path

from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy
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
    ):
        self.js = js
        self.project = project
        self.model = model
        self.engine = engine
        self.on_loaded = on_loaded
        self.cache_dir = Path(cache_dir) / project / model
        self.fetch_attempts = fetch_attempts
        self.retry_delay_s = retry_delay_s
        #: served name -> sha256 of what is loaded under it (a redelivery is not loaded twice).
        self.loaded: dict[str, str] = {}
        self._queue: asyncio.Queue[Msg] = asyncio.Queue()
        self._sub = None
        self._deleted_sub = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        # The subscription callback only enqueues: loading takes seconds, and a slow callback
        # would hold up the client's flow-control replies for this consumer.
        self._sub = await self.js.subscribe(
            subjects.checkpoint("published", self.project, self.model),
            cb=self._queue.put,
            ordered_consumer=True,
            deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
        )
        # Retention deletes old steps; unloading them keeps a long run from holding every
        # adapter it ever trained. Only deletions from now on matter: nothing older is loaded.
        self._deleted_sub = await self.js.subscribe(
            subjects.checkpoint("deleted", self.project, self.model),
            cb=self._queue.put,
            ordered_consumer=True,
            deliver_policy=DeliverPolicy.NEW,
        )
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        for sub in (self._sub, self._deleted_sub):
            if sub is not None:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
        self._sub = self._deleted_sub = None
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            msg = await self._queue.get()
            deleted = msg.subject == subjects.checkpoint("deleted", self.project, self.model)
            content_type = (msg.headers or {}).get(CONTENT_TYPE)
            try:
                with continue_trace(
                    _tracer,
                    "inference.unload_adapter" if deleted else "inference.load_adapter",
                    msg.headers,
                    attributes={"artery.project": self.project, "artery.model": self.model},
                ):
                    if deleted:
                        await self.handle_deleted(msg.data, content_type)
                    else:
                        await self.handle(msg.data, content_type)
            except Exception:  # one bad checkpoint must not stop the replica following the next
                log.exception("checkpoint handling failed", subject=msg.subject)

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
        if self.loaded.get(name) == event.sha256:
            span.set_attribute("artery.already_loaded", True)
            return name  # the same adapter again (a redelivery after a reconnect)
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
