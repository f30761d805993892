"""Follow training: load the newest published adapter into the engine, skipping stale steps.

The watcher follows ``checkpoint.published`` and ``checkpoint.deleted`` of its project/model
through plain NATS subscriptions (the stream's messages are delivered to subscribers as they are
stored), and reads the last published event with a direct get at start and every
``catch_up_s``: a fresh replica loads the newest adapter at once (not every step ever trained),
and one that was disconnected while a step was published catches up. Deletions missed while
disconnected leave an old adapter loaded until the replica restarts; nothing else is lost.

No JetStream consumer: creating one on ARTERY_CHECKPOINTS (an unnamed ordered consumer names
itself in the request body) is a permission with which a replica could change the publisher's
durable consumer; a direct get names its subject, so inference may read this one subject only.

Steps may be published faster than a replica loads them, and retention (keeping one step) then
deletes each step as the next is published. So events are not handled one by one in arrival
order: the subscriptions only record them, and one loop loads the newest step not yet loaded,
skipping the older ones still waiting, then applies the deletions (after the load, so the bare
``<model>`` name never falls back to the base model in between). A step deleted while it is
fetched is given up at once (the fetch is cancelled); one deleted before its load starts is not
loaded. A step that cannot be loaded for good (gone from the Object Store, a sha256 mismatch,
an unsafe archive) is logged and skipped; a transient failure (NATS away, an engine error) is
tried again by the next catch-up.

For a load: fetch the archive from the Object Store, verify the announced sha256, unpack it into
the local cache, load it as ``<model>@<step>`` and tell the serving state through
``on_loaded(step, served_name)``.

With ``load_saved``, the replica also follows ``checkpoint.saved`` and loads the adapter the
trainer put in the trainer-state store as soon as it is announced, so the publisher's copy into
the adapters bucket is off the critical path of a training step. It is read without a consumer
(``shared.trainer_state``, ``shared.object_store``), checked against the saved event's sha256 and
size as a fetch is; the publisher's ``checkpoint.published`` for that step then finds the same sha256 loaded
and does nothing. A saved adapter that cannot be read (NATS away, pruned, another URI such as an
older trainer's ``file://``) is no error: the published event follows, and the adapter comes from
the adapters bucket as without ``load_saved``. Only the trainer may publish ``checkpoint.saved``
and write its store (shared/permissions.py), and the URI must name the event's own model and step,
so no agent can point a replica at another adapter; it is unpacked under the same checks as a
fetched adapter.

With ``load_saved`` the replica also follows ``checkpoint.staged``: the trainer stores a step's
adapter before its optimizer state and says so, and the replica fetches and unpacks the adapter
(under the same checks) while the state is stored. It serves nothing until the step's
``checkpoint.saved`` (or ``checkpoint.published``) names the same sha256, so a step announced as
saved is still the only one served, and its load then skips the fetch. A prefetch that fails, or
whose step is never saved, costs nothing else; only the newest staged step is fetched ahead.
An engine that can read an adapter ahead of serving it (``PreloadsAdapters``: both engines) is
handed the unpacked adapter then too, under a key that serves nothing; the saved step is then
served under its name without being read again.

One way per purpose: published steps come from the adapters bucket, saved ones from the
trainer-state store, never from a file. A file reached only replicas that shared the trainer's
disk, which trainer workers on other hosts do not; a second path for the same bytes would be a
second set of checks and failures to keep right, for no replica that the store does not reach.

``lag()`` says when the replica has served an older step than the newest published one for
longer than ``max_lag_s`` (``/health`` turns that into a 503).

Long module: one watcher whose ordering rules (newest first, deletions after loads, a deletion
cancelling its fetch, the saved fast path) act on one shared state; split, each rule above would
be read in two places.

Each load runs in an ``inference.load_adapter`` span (``inference.unload_adapter`` for a
deletion) that continues the trace the event's headers carry: the publisher's, hence the
trainer's step and the ``train()`` call that asked for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import shutil
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Generic, NamedTuple, TypeVar

from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from opentelemetry import trace

from artery.schemas import CheckpointDeleted, CheckpointPublished, CheckpointSaved, CheckpointStaged
from artery.services.inference.engine.base import Engine, EngineError, PreloadsAdapters
from artery.services.inference.serving import CheckpointLag
from artery.shared import subjects, trainer_state
from artery.shared.adapters import AdapterError, AdapterNotFound, get_adapter, unpack_adapter
from artery.shared.bus import CONTENT_TYPE
from artery.shared.codec import EventDecoder
from artery.shared.errors import DependencyUnavailable, InvalidMessage
from artery.shared.logs import get_logger
from artery.shared.served_name import served_name
from artery.shared.tasks import cancel_and_wait
from artery.shared.tracing import continue_trace, tracer

log = get_logger(__name__)

OnLoaded = Callable[[int, str], Awaitable[None] | None]
_decoder = EventDecoder(CheckpointPublished)
_deleted_decoder = EventDecoder(CheckpointDeleted)
_saved_decoder = EventDecoder(CheckpointSaved)
_staged_decoder = EventDecoder(CheckpointStaged)
_tracer = tracer("inference")
_FIRST_CATCH_UP_ATTEMPTS = 25


#: A checkpoint event the watcher acts on: one to load (published, or saved by the trainer), or
#: a deletion.
_Event = TypeVar("_Event", CheckpointPublished, CheckpointSaved, CheckpointDeleted, covariant=True)
_T = TypeVar("_T")


@dataclass(frozen=True)
class _Received(Generic[_Event]):
    """A decoded checkpoint event and the headers it came with (its trace)."""

    event: _Event
    headers: dict[str, str] | None


#: What the loop loads: a published step, or one the trainer saved (read from its store).
_ToLoad = _Received[CheckpointPublished] | _Received[CheckpointSaved]


class _FetchedAhead(NamedTuple):
    """A staged adapter fetched and unpacked ahead of its ``checkpoint.saved``."""

    sha256: str
    path: Path
    #: The key the engine read it under ahead of serving it (``PreloadsAdapters``), or None.
    preloaded: str | None


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
        max_lag_s: float = 60.0,
        load_saved: bool = False,
        clock: Callable[[], float] = time.monotonic,
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
        self.max_lag_s = max_lag_s
        self.load_saved = load_saved
        self._clock = clock
        self._published = subjects.checkpoint("published", project, model)
        self._deleted = subjects.checkpoint("deleted", project, model)
        self._saved = subjects.checkpoint("saved", project, model)
        self._staged = subjects.checkpoint_staged(project, model)
        #: step -> sha256 of the adapter loaded for it.
        self._steps: dict[int, str] = {}
        #: step -> sha256 of the published event dealt with for good (loaded or refused): what a
        #: catch-up reads again is not handled again.
        self._settled: dict[int, str] = {}
        #: Published steps this replica should serve (not deleted, not refused); the newest counts.
        self._live: set[int] = set()
        #: Deleted steps: never loaded (again), whatever arrives late.
        self._gone: set[int] = set()
        #: step -> its newest published event not handled yet; the loop takes the highest.
        self._pending: dict[int, _ToLoad] = {}
        #: step -> its published event, set aside while the same bytes load from the trainer's
        #: store; queued again if that load fails (an adapter this replica cannot read after all).
        self._published_aside: dict[int, _Received[CheckpointPublished]] = {}
        #: step -> its deletion, applied after the next load.
        self._deletions: dict[int, _Received[CheckpointDeleted]] = {}
        self._fetching: tuple[int, asyncio.Task] | None = None
        #: step -> the fetch ahead of its staged adapter: what it fetched once done (None if it
        #: failed); taken by the load of that step.
        self._prefetches: dict[int, asyncio.Task[_FetchedAhead | None]] = {}
        #: Preloaded adapters being dropped from the engine (a fetch ahead that nothing will load).
        self._dropping: set[asyncio.Task] = set()
        self._cache_thread: ThreadPoolExecutor | None = None
        #: The step the loop is loading now: never fetched ahead meanwhile, which would replace
        #: its directory under the engine.
        self._loading: int | None = None
        self._behind_since: float | None = None
        self._wake = asyncio.Event()
        #: Set after each round of the loop: what ``caught_up`` waits on.
        self._progressed = asyncio.Event()
        self._stopping = asyncio.Event()
        self._subs: list = []
        self._tasks: list[asyncio.Task] = []

    @property
    def loaded(self) -> dict[str, str]:
        """Served name -> sha256 of what is loaded under it."""
        return {served_name(self.model, step): sha for step, sha in self._steps.items()}

    @property
    def settled_steps(self) -> set[int]:
        """Published steps dealt with for good: loaded (or found loaded already) or refused."""
        return set(self._settled)

    @property
    def newest_step(self) -> int | None:
        """The newest published step this replica knows of and should serve."""
        return max(self._live, default=None)

    @property
    def served_step(self) -> int:
        """The newest step loaded; 0 when only the base model is served."""
        return max(self._steps, default=0)

    def lag(self) -> CheckpointLag | None:
        """How far behind training this replica is, once it has been behind for over ``max_lag_s``."""
        if self._behind_since is None:
            return None
        behind_s = self._clock() - self._behind_since
        if behind_s <= self.max_lag_s:
            return None
        newest = self.newest_step or 0
        return CheckpointLag(newest_step=newest, served_step=self.served_step, behind_s=behind_s)

    async def start(self) -> None:
        self._stopping.clear()
        nc = self.js._nc  # the client the context was made from
        # The callbacks only record: loading takes seconds, and one slow callback would hold up
        # every other subscription of the connection.
        self._subs = [
            await nc.subscribe(self._published, cb=self._on_published),
            await nc.subscribe(self._deleted, cb=self._on_deleted),
        ]
        if self.load_saved:
            self._subs.append(await nc.subscribe(self._saved, cb=self._on_saved))
            self._subs.append(await nc.subscribe(self._staged, cb=self._on_staged))
        # After subscribing: an event published in between is read twice, and loaded once.
        await self._first_catch_up()
        self._tasks = [asyncio.create_task(self._run()), asyncio.create_task(self._keep_catching_up())]

    async def stop(self) -> None:
        # The loops end on ``_stopping`` too, not on cancellation alone: a cancel that lands as a
        # nats-py request's reply arrives can be swallowed inside it (asyncio.wait_for on 3.11).
        self._stopping.set()
        self._wake.set()
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._subs = []
        for task in [*self._tasks, *self._prefetches.values()]:
            await cancel_and_wait(task)
        self._tasks, self._prefetches = [], {}
        if self._cache_thread is not None:
            self._cache_thread.shutdown(wait=False)  # what was asked of it still runs
            self._cache_thread = None

    # -- what arrives ------------------------------------------------------------------------

    async def _on_published(self, msg) -> None:
        self._offer(msg.data, msg.headers, live=True)

    async def _on_saved(self, msg) -> None:
        """A step as the trainer saved it, before the publisher has copied it: loaded if it is the
        newest."""
        try:
            event = _saved_decoder.decode(msg.data, (msg.headers or {}).get(CONTENT_TYPE))
        except InvalidMessage as exc:
            log.warning("unreadable checkpoint.saved; waiting for the published event", error=str(exc))
            return
        if event.step is None or event.step in self._gone or event.step <= self.served_step:
            return  # nothing to gain: a newer (or this) step is served already
        if event.step in self._pending:
            return  # its published event came first: that one is loaded
        self._pending[event.step] = _Received(event, msg.headers)
        self._wake.set()

    async def _on_staged(self, msg) -> None:
        """A step's adapter stored ahead of its state: fetched and unpacked now, served once saved."""
        try:
            event = _staged_decoder.decode(msg.data, (msg.headers or {}).get(CONTENT_TYPE))
        except InvalidMessage as exc:
            log.warning("unreadable checkpoint.staged; ignored", error=str(exc))
            return
        step = event.step
        if step is None or step in self._gone or step <= self.served_step or step in self._prefetches:
            return
        if step == self._loading:  # a step trained again, staged while its first bytes load
            return
        for older in [s for s in self._prefetches if s < step]:
            self._drop_prefetch(older)  # training has moved past it
        self._prefetches[step] = asyncio.create_task(self._prefetch(step, event))

    async def _on_deleted(self, msg) -> None:
        try:
            event = _deleted_decoder.decode(msg.data, (msg.headers or {}).get(CONTENT_TYPE))
        except InvalidMessage as exc:
            log.error("unreadable checkpoint.deleted; skipped", error=str(exc))
            return
        if event.step is None:
            return
        self._gone.add(event.step)
        self._live.discard(event.step)
        self._pending.pop(event.step, None)
        self._drop_prefetch(event.step)
        self._deletions[event.step] = _Received(event, msg.headers)
        if self._fetching is not None and self._fetching[0] == event.step:
            self._fetching[1].cancel()  # its chunks are being purged: waiting serves nothing
        self._track_lag()
        self._wake.set()

    def _offer(self, data: bytes, headers: dict[str, str] | None, *, live: bool) -> None:
        """Record a published event for the loop, unless it was dealt with already."""
        try:
            event = _decoder.decode(data, (headers or {}).get(CONTENT_TYPE))
        except InvalidMessage as exc:
            if live:  # a catch-up reads the same bytes again: said once is enough
                log.error("unreadable checkpoint.published; skipped", error=str(exc))
            return
        if event.step is None:
            if live:
                log.error("checkpoint.published without a step; skipped", object_name=event.object_name)
            return
        if event.step in self._gone or self._settled.get(event.step) == event.sha256:
            return
        self._live.add(event.step)
        waiting = self._pending.get(event.step)
        if isinstance(waiting, _Received) and isinstance(waiting.event, CheckpointSaved):
            if waiting.event.sha256 == event.sha256:
                self._published_aside[event.step] = _Received(event, headers)
                self._track_lag()
                return  # the same bytes are about to be loaded from the trainer's store
        self._pending[event.step] = _Received(event, headers)
        self._track_lag()
        self._wake.set()

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
        try:
            last = await self.js.get_last_msg(subjects.CHECKPOINTS.name, self._published, direct=True)
        except NotFoundError:
            return  # nothing published yet
        self._offer(last.data or b"", last.headers, live=False)

    async def _keep_catching_up(self) -> None:
        while not self._stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self.catch_up_s)
                return
            try:
                await self._catch_up()
            except Exception as exc:  # NATS away: the next round tries again
                log.warning("checkpoint catch-up failed", error=repr(exc))

    # -- the loop ----------------------------------------------------------------------------

    async def _run(self) -> None:
        while not self._stopping.is_set():
            if not self._pending and not self._deletions:
                self._wake.clear()
                await self._wake.wait()
                continue
            if self._pending:
                step, received = self._take_newest()
                if not self._loaded_already(step, received.event):
                    self._loading = step
                    try:
                        await self._handle(
                            received, "inference.load_adapter", self._load(step, received.event)
                        )
                    finally:
                        self._loading = None
            deletions, self._deletions = self._deletions, {}
            for step, deletion in sorted(deletions.items()):
                await self._handle(deletion, "inference.unload_adapter", self._unload(step, deletion.event))
            self._progressed.set()

    async def caught_up(self, timeout_s: float) -> bool:
        """Until the newest step known now is dealt with (loaded, refused or deleted); False if
        ``timeout_s`` passed first. A replica that says it is ready serves what was published
        before it started: a client routed to it right away must not find the newest step missing."""
        target = self.newest_step
        deadline = self._clock() + timeout_s
        while target is not None and target not in self._settled and target not in self._gone:
            remaining = deadline - self._clock()
            if remaining <= 0 or self._stopping.is_set():
                return False
            self._progressed.clear()  # no await since the check: no round can finish unseen
            try:
                await asyncio.wait_for(self._progressed.wait(), remaining)
            except TimeoutError:
                return False
        return True

    def _loaded_already(self, step: int, event: CheckpointPublished | CheckpointSaved) -> bool:
        """A published step whose bytes were loaded as saved by the trainer: settled, no second load."""
        if isinstance(event, CheckpointPublished) and self._steps.get(step) == event.sha256:
            self._settled[step] = event.sha256
            self._track_lag()
            return True
        return False

    def _take_newest(self) -> tuple[int, _ToLoad]:
        """The highest pending step; the lower ones are skipped (training has moved past them)."""
        step = max(self._pending)
        received = self._pending.pop(step)
        if self._pending:
            log.info("stale steps skipped; loading the newest", skipped=sorted(self._pending), step=step)
            self._pending.clear()
        return step, received

    async def _handle(self, received: _Received, span_name: str, work: Awaitable[object]) -> None:
        try:
            with continue_trace(
                _tracer,
                span_name,
                received.headers,
                attributes={
                    "artery.project": self.project,
                    "artery.model": self.model,
                    "artery.step": received.event.step,
                },
            ):
                await work
        except Exception:  # one bad checkpoint must not stop the replica following the next
            log.exception("checkpoint handling failed", step=received.event.step)
        self._track_lag()

    async def _load(self, step: int, event: CheckpointPublished | CheckpointSaved) -> str | None:
        """Load one published (or, with ``load_saved``, saved) step; its served name, else None."""
        name = served_name(self.model, step)
        trace.get_current_span().set_attribute("artery.served_name", name)
        if isinstance(event, CheckpointSaved):
            return await self._load_saved(step, name, event)
        if event.served_name != name:
            log.warning(
                "served_name differs from <model>@<step>; using the latter", announced=event.served_name
            )
        if self._steps.get(step) == event.sha256:
            self._settled[step] = event.sha256
            return name  # the same adapter again
        ahead = await self._take_prefetch(step, event.sha256)
        if ahead is not None:
            path, source, preloaded = ahead.path, "staged", ahead.preloaded
        else:
            fetched = await self._fetch_and_unpack(step, name, event)
            if fetched is None:
                self._refuse(step, event.sha256)
                return None
            path, source, preloaded = fetched, "published", None
        if await self._serve(step, name, path, event.sha256, source=source, preloaded=preloaded):
            self._settled[step] = event.sha256
            return name
        return None

    async def _fetch_and_unpack(self, step: int, name: str, event: CheckpointPublished) -> Path | None:
        """A published adapter from the adapters bucket, unpacked; None when gone or refused."""
        archive = await self._fetch(step, event.object_name)
        if archive is None:
            return None
        try:
            dest = self._step_dir(step)
            return await self._on_disk(unpack_adapter, archive, dest, event.sha256)
        except AdapterError as exc:
            log.error("adapter refused; not loaded", served_name=name, error=str(exc))
            return None

    async def _load_saved(self, step: int, name: str, event: CheckpointSaved) -> str | None:
        """The trainer's archive from its store; None (the published event follows) when unreadable."""
        ahead = await self._take_prefetch(step, event.sha256)
        if ahead is not None:
            path, source, preloaded = ahead.path, "staged", ahead.preloaded
        else:
            source, preloaded = "saved", None
            try:
                path = await self._from_trainer_store(step, event)
            except (InvalidMessage, DependencyUnavailable, OSError, AdapterError) as exc:
                log.info(
                    "saved adapter not loadable here; waiting for it published", step=step, error=str(exc)
                )
                self._published_instead(step)
                return None
        if await self._serve(step, name, path, event.sha256, source=source, preloaded=preloaded):
            self._published_aside = {s: r for s, r in self._published_aside.items() if s > step}
            return name
        self._published_instead(step)
        return None

    async def _prefetch(self, step: int, event: CheckpointStaged) -> _FetchedAhead | None:
        """A staged adapter fetched and unpacked, and read by the engine where it can be, not
        served; None when the fetch failed (its load fetches it as if it had not been staged)."""
        try:
            path = await self._from_trainer_store(step, event)
        except Exception as exc:  # a hint's failure is never the load's: that fetches as before
            log.info("staged adapter not fetched ahead; fetched when saved", step=step, error=str(exc))
            return None
        preloaded = None
        if isinstance(self.engine, PreloadsAdapters):
            # Keyed by its bytes too: a step trained again is a new key, never this one served.
            key = f"{served_name(self.model, step)} staged {event.sha256}"
            try:
                await self.engine.preload_adapter(key, path)
                preloaded = key
            except EngineError as exc:  # served as fetched: the load reads it as before
                log.info("staged adapter not read ahead by the engine", step=step, error=str(exc))
        log.info(
            "staged adapter fetched ahead", step=step, sha256=event.sha256, read_ahead=preloaded is not None
        )
        return _FetchedAhead(event.sha256, path, preloaded)

    async def _from_trainer_store(self, step: int, event: CheckpointSaved | CheckpointStaged) -> Path:
        """The adapter ``event`` names in the trainer-state store (only this model's step is
        read), checked against its sha256 and size and unpacked; raises what the reads raise."""
        stored = trainer_state.adapter_object(event.uri, self.project, self.model, step)
        data = await trainer_state.get(self.js, stored, sha256=event.sha256, size=event.size_bytes)
        return await self._on_disk(unpack_adapter, data, self._step_dir(step), event.sha256)

    async def _take_prefetch(self, step: int, sha256: str) -> _FetchedAhead | None:
        """What was fetched ahead for ``step`` if it holds ``sha256`` (waiting for a fetch still
        under way: it has a head start on any fetch begun now); None otherwise."""
        task = self._prefetches.pop(step, None)
        if task is None:
            return None
        fetched = await task
        if fetched is None:
            return None
        if fetched.sha256 != sha256:  # the step was trained again into other bytes: fetched as announced
            if fetched.preloaded is not None:
                await self._drop_preloaded(fetched.preloaded)
            return None
        return fetched

    def _drop_prefetch(self, step: int) -> None:
        """Forget a fetch ahead that nothing will load (a newer step staged, or this one deleted):
        the engine's copy, and what it unpacked (after it, on the cache's thread: ``_on_disk``).
        One cancelled while the engine reads it is dropped by the engine (``preload_adapter``)."""
        task = self._prefetches.pop(step, None)
        if task is None:
            return
        task.cancel()
        self._disk().submit(shutil.rmtree, self._step_dir(step), True)
        if task.done() and not task.cancelled() and (fetched := task.result()) and fetched.preloaded:
            dropping = asyncio.create_task(self._drop_preloaded(fetched.preloaded))
            self._dropping.add(dropping)
            dropping.add_done_callback(self._dropping.discard)

    async def _drop_preloaded(self, key: str) -> None:
        assert isinstance(self.engine, PreloadsAdapters)
        try:
            await self.engine.drop_preloaded(key)
        except Exception as exc:  # the engine's cache pushes it out in time
            log.warning("preloaded adapter not dropped", key=key, error=repr(exc))

    def _step_dir(self, step: int) -> Path:
        """Where a step's adapter is unpacked, and read by the engine while it is served."""
        return self.cache_dir / f"step-{step}"

    def _disk(self) -> ThreadPoolExecutor:
        if self._cache_thread is None:
            self._cache_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="adapter-cache")
        return self._cache_thread

    async def _on_disk(self, fn: Callable[..., _T], *args: object) -> _T:
        """Run a change to the adapter cache on its one thread, in the order asked. A fetch ahead
        cancelled while it unpacks goes on writing its step's directory (a thread cannot be
        cancelled); a load or removal of that step asked after it must come after it, not beside
        it in another thread."""
        return await asyncio.get_running_loop().run_in_executor(self._disk(), partial(fn, *args))

    def _published_instead(self, step: int) -> None:
        """The saved load failed: the published event set aside for it (if it came) goes back in
        the queue, unless something newer or a deletion came meanwhile."""
        aside = self._published_aside.pop(step, None)
        if aside is not None and step not in self._gone and not any(s >= step for s in self._pending):
            self._pending[step] = aside
            self._wake.set()

    async def _serve(
        self,
        step: int,
        name: str,
        path: Path,
        sha256: str,
        source: str = "published",
        preloaded: str | None = None,
    ) -> bool:
        """Hand an unpacked adapter to the engine under ``name`` (``preloaded``: the key the
        engine has read it under already) and announce it."""
        if step in self._gone:  # deleted while it was unpacked
            log.info("adapter deleted before it was loaded; skipped", served_name=name)
            if preloaded is not None:
                await self._drop_preloaded(preloaded)
            await self._on_disk(shutil.rmtree, path, True)
            return False
        if step in self._steps:  # a step re-published with other bytes: replace what is served
            with contextlib.suppress(Exception):
                await self.engine.unload_adapter(name)
        if preloaded is not None:
            assert isinstance(self.engine, PreloadsAdapters)
            await self.engine.serve_preloaded(name, preloaded)
        else:
            await self.engine.load_adapter(name, path)
        self._steps[step] = sha256
        self._track_lag()
        log.info(
            "adapter loaded", served_name=name, sha256=sha256, source=source, read_ahead=preloaded is not None
        )
        result = self.on_loaded(step, name)
        if inspect.isawaitable(result):
            await result
        return True

    def _refuse(self, step: int, sha256: str) -> None:
        """Dealt with for good without loading: not served, so nobody waits on it either."""
        self._settled[step] = sha256
        self._live.discard(step)

    async def _unload(self, step: int, event: CheckpointDeleted) -> str | None:
        """Unload a deleted step; the served name when it was loaded."""
        name = served_name(self.model, step)
        if step not in self._steps:
            return None
        await self.engine.unload_adapter(name)
        del self._steps[step]
        await self._on_disk(shutil.rmtree, self._step_dir(step), True)
        log.info("adapter unloaded", served_name=name, reason=event.reason)
        return name

    async def _fetch(self, step: int, object_name: str) -> bytes | None:
        """The archive; None when it is gone or refused for good; raises when NATS kept failing.

        The fetch runs as a task of its own so that a ``checkpoint.deleted`` of this step cancels
        it (``_on_deleted``), whatever it is waiting for.
        """
        for attempt in range(1, self.fetch_attempts + 1):
            if step in self._gone:
                return None
            task = asyncio.create_task(get_adapter(self.js, object_name))
            self._fetching = (step, task)
            try:
                await asyncio.wait({task})
            finally:
                self._fetching = None
                task.cancel()  # only does something when this watcher is stopped meanwhile
            if task.cancelled():
                log.info("adapter deleted while it was fetched; skipped", object_name=object_name)
                return None
            exc = task.exception()
            if exc is None:
                return task.result()
            if isinstance(exc, AdapterNotFound):  # retention removed it, or it never arrived
                log.warning("adapter not in the object store; skipped", error=str(exc))
                return None
            if isinstance(exc, AdapterError):
                log.error("adapter refused; skipped", error=str(exc))
                return None
            log.warning("adapter fetch failed", object_name=object_name, attempt=attempt, error=repr(exc))
            if attempt == self.fetch_attempts:
                raise exc  # not settled: the next catch-up tries again
            await asyncio.sleep(self.retry_delay_s * attempt)
        return None

    def _track_lag(self) -> None:
        newest = self.newest_step
        if newest is None or self.served_step >= newest:
            self._behind_since = None
        elif self._behind_since is None:
            self._behind_since = self._clock()
