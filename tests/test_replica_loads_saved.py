"""A replica serves a step as soon as it is saved (#11), wherever the trainer runs (#30).

The publisher's copy into the Object Store is then off the critical path of a training step: the
replica reads the trainer's archive from the trainer-state store, checks it against
``checkpoint.saved``'s sha256, and the publisher's ``checkpoint.published`` for that step finds it
loaded already. Where the replica cannot read it (not stored, or a URI it never reads, such as an
older trainer's ``file://``), the published event brings the adapter as before.

Real nats-server, PostgreSQL and publisher; the engine records its loads.
"""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from artery.schemas import CheckpointDeleted, CheckpointStaged
from artery.schemas.base import new_event_id
from artery.services.inference.checkpoints import CheckpointWatcher
from artery.services.inference.engine.base import EngineError, PreloadsAdapters
from artery.services.publisher.service import object_name
from artery.services.trainer import announce
from artery.shared import subjects, trainer_state
from artery.shared.adapters import put_adapter, sha256_hex
from artery.shared.bus import publish_event
from tests.test_publisher import MODEL, PROJECT, SAVED, published_event, saved_event, write_adapter
from tests.test_replica_follows import following, publishing, until

pytestmark = pytest.mark.timeout(120)
WAIT_S = 30.0


class PreloadingEngine:
    """Reads adapters ahead of serving them, as vLLM does (``PreloadsAdapters``): each adapter's
    bytes are read when it is loaded or preloaded, so a test sees which bytes each name serves."""

    kind = "preloading"

    def __init__(self, *, refuse_preloads: bool = False) -> None:
        self.serving: dict[str, bytes] = {}
        self.preloaded: dict[str, bytes] = {}
        self.loads: list[tuple[str, str]] = []  # (how, name): "load" or "preloaded"
        self.dropped: list[str] = []
        self.refuse_preloads = refuse_preloads
        self.loaded_event = asyncio.Event()

    @staticmethod
    def _read(path) -> bytes:
        return (path / "adapter_model.safetensors").read_bytes()

    async def load_adapter(self, name: str, path) -> None:
        self.serving[name] = self._read(path)
        self.loads.append(("load", name))
        self.loaded_event.set()

    async def preload_adapter(self, key: str, path) -> None:
        if self.refuse_preloads:
            raise EngineError("no room for another adapter")
        self.preloaded[key] = self._read(path)

    async def serve_preloaded(self, name: str, key: str) -> None:
        self.serving[name] = self.preloaded.pop(key)
        self.loads.append(("preloaded", name))
        self.loaded_event.set()

    async def drop_preloaded(self, key: str) -> None:
        self.dropped.append(key)
        self.preloaded.pop(key, None)

    async def unload_adapter(self, name: str) -> None:
        del self.serving[name]

    def adapters(self) -> list[str]:
        return list(self.serving)

    async def next_load(self) -> None:
        await asyncio.wait_for(self.loaded_event.wait(), WAIT_S)
        self.loaded_event.clear()


class RecordingEngine:
    """Loads at once; ``loaded_event`` is set on every load, so a test waits on the load itself."""

    kind = "recording"

    def __init__(self) -> None:
        self.started: list[str] = []
        self.loaded_event = asyncio.Event()

    async def load_adapter(self, name: str, path) -> None:
        self.started.append(name)
        self.loaded_event.set()

    async def unload_adapter(self, name: str) -> None:
        self.started.remove(name)

    def adapters(self) -> list[str]:
        return list(self.started)

    async def next_load(self) -> None:
        await asyncio.wait_for(self.loaded_event.wait(), WAIT_S)
        self.loaded_event.clear()


def watcher_for(js, engine, tmp_path, name: str, *, load_saved: bool, announced: list | None = None):
    def on_loaded(step: int, served: str) -> None:
        if announced is not None:
            announced.append(step)

    return CheckpointWatcher(
        js, PROJECT, MODEL, engine, on_loaded, cache_dir=tmp_path / name, load_saved=load_saved
    )


async def test_a_saved_step_is_served_before_it_is_published_and_loaded_once(nc, js, database_url, tmp_path):
    fast, slow = RecordingEngine(), RecordingEngine()
    announced: list[int] = []
    fast_watcher = watcher_for(js, fast, tmp_path, "fast", load_saved=True, announced=announced)
    slow_watcher = watcher_for(js, slow, tmp_path, "slow", load_saved=False)
    published = subjects.checkpoint("published", PROJECT, MODEL)
    published_seen = asyncio.Event()

    async def seen(msg) -> None:
        published_seen.set()

    sub = await nc.subscribe(published, cb=seen)
    await nc.flush()  # the subscription is on the server before anything can be published
    _, data = write_adapter(tmp_path / "trainer", 1, size=50_000)
    stored = trainer_state.object_name(PROJECT, MODEL, 1, trainer_state.ADAPTER)
    await trainer_state.put(js, stored, data)  # what the trainer does, from whichever host it runs on
    uri = trainer_state.uri(stored)
    async with following(fast_watcher), following(slow_watcher):
        # No publisher yet: only the trainer's checkpoint.saved exists.
        await publish_event(js, SAVED, saved_event(uri, data, 1))
        await fast.next_load()
        assert fast.started == [f"{MODEL}@1"] and announced == [1]
        assert fast_watcher.loaded == {f"{MODEL}@1": sha256_hex(data)}
        assert slow.started == []  # without load_saved a replica waits for the published event

        async with publishing(nc, database_url, keep_latest=10):
            await asyncio.wait_for(published_seen.wait(), WAIT_S)
            await slow.next_load()  # the Object Store path, for the replica that waited
            await until(lambda: 1 in fast_watcher.settled_steps)  # it saw step 1 published too...
            assert fast.started == [f"{MODEL}@1"]  # ...and found those bytes loaded: no second load
            assert announced == [1]
            assert fast_watcher.newest_step == 1 and fast_watcher.lag() is None
            assert slow.started == [f"{MODEL}@1"]
    await sub.unsubscribe()


async def test_a_saved_adapter_this_replica_cannot_read_waits_for_the_published_adapter(nc, js, tmp_path):
    engine = RecordingEngine()
    watcher = watcher_for(js, engine, tmp_path, "replica", load_saved=True)
    _, data = write_adapter(tmp_path / "trainer", 1, size=50_000)
    # Never stored (or pruned meanwhile): the store says not found.
    missing = trainer_state.uri(trainer_state.object_name(PROJECT, MODEL, 1, trainer_state.ADAPTER))
    async with following(watcher):
        await publish_event(js, SAVED, saved_event(missing, data, 1))
        name = object_name(PROJECT, MODEL, 1)
        await put_adapter(js, name, data)  # what the publisher, on the trainer's machine, does
        event = published_event(name, data, 1)
        await publish_event(js, subjects.checkpoint("published", PROJECT, MODEL), event)
        await engine.next_load()
        assert engine.started == [f"{MODEL}@1"]
        assert watcher.loaded == {f"{MODEL}@1": sha256_hex(data)}


async def test_a_published_event_set_aside_for_a_saved_load_that_fails_is_loaded_next(js, tmp_path):
    """The published event of a step whose saved load is pending is set aside (the same bytes are
    about to load as saved); if the saved adapter turns out unreadable (here an older trainer's
    file URI, which replicas never read), that event is queued again at once, not left for the
    periodic catch-up. Driven step by step, without the watcher's loop."""
    from types import SimpleNamespace

    from artery.schemas import CheckpointPublished
    from artery.shared.bus import event_headers
    from artery.shared.codec import encode

    def message(event):
        return SimpleNamespace(data=encode(event), headers=event_headers(event))

    watcher = watcher_for(js, RecordingEngine(), tmp_path, "replica", load_saved=True)
    uri, data = write_adapter(tmp_path / "trainer", 1, size=50_000)
    saved = saved_event(uri.replace("/trainer/", "/on-another-machine/"), data, 1)
    published = published_event(object_name(PROJECT, MODEL, 1), data, 1)
    await watcher._on_saved(message(saved))
    await watcher._on_published(message(published))
    assert isinstance(watcher._pending[1].event, type(saved))  # the saved load goes first
    step, received = watcher._take_newest()
    assert await watcher._load(step, received.event) is None  # not read from a file
    assert isinstance(watcher._pending[1].event, CheckpointPublished)  # loaded next, from the store


# -- fetched ahead: checkpoint.staged ------------------------------------------------------------


def staged_event(uri: str, data: bytes, step: int) -> CheckpointStaged:
    """The trainer's hint ahead of the ``checkpoint.saved`` that ``saved_event`` makes."""
    fields = msgspec.structs.asdict(saved_event(uri, data, step))
    del fields["metrics"]
    return CheckpointStaged(**fields)


async def stored_as_trainer_does(js, step: int, data: bytes) -> str:
    """The adapter in the trainer-state store; its URI."""
    name = trainer_state.object_name(PROJECT, MODEL, step, trainer_state.ADAPTER)
    await trainer_state.put(js, name, data)
    return trainer_state.uri(name)


async def fetched_ahead(watcher: CheckpointWatcher, step: int):
    """Once the hint is heard, the fetch ahead's outcome: (sha256, directory), or None."""
    await until(lambda: step in watcher._prefetches)
    return await watcher._prefetches[step]


async def test_a_staged_adapter_is_fetched_ahead_and_served_only_once_saved(js, tmp_path):
    engine, announced = RecordingEngine(), []
    watcher = watcher_for(js, engine, tmp_path, "replica", load_saved=True, announced=announced)
    _, data = write_adapter(tmp_path / "trainer", 1, size=50_000)
    uri = await stored_as_trainer_does(js, 1, data)
    async with following(watcher):
        await announce.stage(js, staged_event(uri, data, 1))  # as the trainer sends it
        ahead = await fetched_ahead(watcher, 1)
        assert ahead.sha256 == sha256_hex(data) and (ahead.path / "adapter_model.safetensors").is_file()
        assert ahead.preloaded is None  # this engine reads adapters only when it serves them
        assert engine.started == [] and announced == []  # a hint serves nothing
        # Gone from the store: only what was fetched ahead can serve step 1 now.
        await (await js.object_store(trainer_state.BUCKET)).delete(
            trainer_state.adapter_object(uri, PROJECT, MODEL, 1)
        )
        await publish_event(js, SAVED, saved_event(uri, data, 1))
        await engine.next_load()
        assert engine.started == [f"{MODEL}@1"] and announced == [1]
        assert watcher.loaded == {f"{MODEL}@1": sha256_hex(data)}


async def test_a_step_saved_with_other_bytes_than_staged_serves_the_saved_bytes(js, tmp_path):
    """A request trained again after a crash stages and saves under the same step; what
    ``checkpoint.saved`` names is what is served."""
    engine = RecordingEngine()
    watcher = watcher_for(js, engine, tmp_path, "replica", load_saved=True)
    _, first = write_adapter(tmp_path / "first", 1, size=50_000)
    _, second = write_adapter(tmp_path / "second", 1, size=60_000)
    async with following(watcher):
        uri = await stored_as_trainer_does(js, 1, first)
        await announce.stage(js, staged_event(uri, first, 1))
        assert (await fetched_ahead(watcher, 1)).sha256 == sha256_hex(first)
        await stored_as_trainer_does(js, 1, second)
        await publish_event(js, SAVED, saved_event(uri, second, 1))
        await engine.next_load()
        assert watcher.loaded == {f"{MODEL}@1": sha256_hex(second)}


async def test_a_fetch_ahead_is_dropped_for_a_newer_step_and_refused_for_another_models_object(js, tmp_path):
    watcher = watcher_for(js, RecordingEngine(), tmp_path, "replica", load_saved=True)
    _, one = write_adapter(tmp_path / "one", 1, size=50_000)
    _, two = write_adapter(tmp_path / "two", 2, size=50_000)
    async with following(watcher):
        await announce.stage(js, staged_event(await stored_as_trainer_does(js, 1, one), one, 1))
        assert await fetched_ahead(watcher, 1) is not None
        # A hint naming another model's object is never fetched (the URI must be this model's step).
        other = trainer_state.uri(
            trainer_state.object_name(PROJECT, "someone-else", 2, trainer_state.ADAPTER)
        )
        await announce.stage(js, staged_event(other, two, 2))
        assert await fetched_ahead(watcher, 2) is None
        # Training moved past step 1: nothing will load it, and what it unpacked is removed.
        assert 1 not in watcher._prefetches
        await watcher._on_disk(lambda: None)  # the cache's thread has done what was asked before
        assert not watcher._step_dir(1).exists()
        await nc_publish_garbage(js, subjects.checkpoint_staged(PROJECT, MODEL))
        await announce.stage(js, staged_event(await stored_as_trainer_does(js, 3, two), two, 3))
        assert await fetched_ahead(watcher, 3) is not None  # still following after a garbled hint
        # A step deleted before it is saved: its fetch ahead goes too.
        deleted = CheckpointDeleted(
            id=new_event_id(),
            project=PROJECT,
            model=MODEL,
            step=3,
            object_name=object_name(PROJECT, MODEL, 3),
        )
        await publish_event(js, subjects.checkpoint("deleted", PROJECT, MODEL), deleted)
        await until(lambda: 3 not in watcher._prefetches)
        await watcher._on_disk(lambda: None)
        assert not watcher._step_dir(3).exists()


async def nc_publish_garbage(js, subject: str) -> None:
    await js._nc.publish(subject, b"\x00not an event")


def weights(step: int, size: int) -> bytes:
    """The weights file of ``write_adapter(root, step, size=size)``."""
    return bytes([step % 256]) * size


async def test_an_engine_that_reads_ahead_serves_the_staged_adapter_it_read_once_saved(js, tmp_path):
    engine = PreloadingEngine()
    assert isinstance(engine, PreloadsAdapters) and not isinstance(RecordingEngine(), PreloadsAdapters)
    watcher = watcher_for(js, engine, tmp_path, "replica", load_saved=True)
    _, first = write_adapter(tmp_path / "first", 1, size=50_000)
    _, second = write_adapter(tmp_path / "second", 2, size=60_000)
    _, other = write_adapter(tmp_path / "other", 2, size=70_000)
    async with following(watcher):
        uri = await stored_as_trainer_does(js, 1, first)
        await announce.stage(js, staged_event(uri, first, 1))
        ahead = await fetched_ahead(watcher, 1)
        assert engine.preloaded == {ahead.preloaded: weights(1, 50_000)} and engine.serving == {}
        await publish_event(js, SAVED, saved_event(uri, first, 1))
        await engine.next_load()
        # Served under its name from what the engine read ahead, never read a second time.
        assert engine.loads == [("preloaded", f"{MODEL}@1")] and engine.preloaded == {}
        assert engine.serving == {f"{MODEL}@1": weights(1, 50_000)}

        # Step 2 staged, then trained again into other bytes (a redelivered request) and saved:
        # the bytes read ahead are dropped and the saved ones served.
        uri = await stored_as_trainer_does(js, 2, second)
        await announce.stage(js, staged_event(uri, second, 2))
        stale = (await fetched_ahead(watcher, 2)).preloaded
        await stored_as_trainer_does(js, 2, other)
        await publish_event(js, SAVED, saved_event(uri, other, 2))
        await engine.next_load()
        assert engine.loads[-1] == ("load", f"{MODEL}@2") and engine.dropped == [stale]
        assert engine.serving[f"{MODEL}@2"] == weights(2, 70_000)
        assert engine.preloaded == {}


async def test_a_read_ahead_is_dropped_for_a_newer_step_and_a_refused_one_loads_as_fetched(js, tmp_path):
    engine = PreloadingEngine()
    watcher = watcher_for(js, engine, tmp_path, "replica", load_saved=True)
    _, one = write_adapter(tmp_path / "one", 1, size=50_000)
    _, two = write_adapter(tmp_path / "two", 2, size=50_000)
    async with following(watcher):
        await announce.stage(js, staged_event(await stored_as_trainer_does(js, 1, one), one, 1))
        first = (await fetched_ahead(watcher, 1)).preloaded
        engine.refuse_preloads = True
        uri = await stored_as_trainer_does(js, 2, two)
        await announce.stage(js, staged_event(uri, two, 2))
        # Training moved past step 1: the engine forgets what it read of it.
        assert (await fetched_ahead(watcher, 2)).preloaded is None
        await until(lambda: engine.dropped == [first])
        assert engine.preloaded == {}
        # Step 2 was fetched but not read ahead: it is loaded from what was fetched.
        await publish_event(js, SAVED, saved_event(uri, two, 2))
        await engine.next_load()
        assert engine.loads == [("load", f"{MODEL}@2")]
        assert engine.serving == {f"{MODEL}@2": weights(2, 50_000)}
