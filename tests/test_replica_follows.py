"""A replica follows training when steps come faster than it loads them and retention keeps one.

The incident: five quick steps, retention deleting each previous step as the next was published,
and the replica never served any of them. nats-py's ``ObjectStore.get`` had read step 1's
metadata, retention purged its chunks, and the ordered consumer it then read them through waited
forever for chunks that were gone; the watcher, handling one event at a time, never saw the rest.

Real nats-server, PostgreSQL and publisher; the replica's engine loads only when the test lets it,
and its JetStream context can hold back its first read of an adapter's chunks, which opens that
window on demand.
"""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest
from nats.js import JetStreamContext

from artery.services.inference.api import create_app
from artery.services.inference.checkpoints import CheckpointWatcher
from artery.services.inference.serving import CheckpointLag, ServingState
from artery.services.publisher.service import Publisher, object_name
from artery.services.publisher.settings import PublisherSettings
from artery.shared import subjects
from artery.shared.adapters import AdapterNotFound, adapter_info, put_adapter, read_adapter
from artery.shared.bus import publish_event
from tests.helpers import wait_for
from tests.test_publisher import MODEL, PROJECT, SAVED, object_exists, saved_event, write_adapter

pytestmark = pytest.mark.timeout(120)
OBJECTS = f"OBJ_{subjects.ADAPTERS_BUCKET}"
CHUNKS = f"$O.{subjects.ADAPTERS_BUCKET}.C."
MAX_LAG_S = 30.0


class SlowEngine:
    """Starts loads at once and finishes them when the test sets ``finish_loads``."""

    kind = "slow"

    def __init__(self) -> None:
        self.started: list[str] = []
        self.served: list[str] = []
        self.loading = asyncio.Event()
        self.finish_loads = asyncio.Event()

    async def load_adapter(self, name: str, path) -> None:
        self.started.append(name)
        self.loading.set()
        await self.finish_loads.wait()
        self.served.append(name)

    async def unload_adapter(self, name: str) -> None:
        self.served.remove(name)

    def adapters(self) -> list[str]:
        return list(self.served)


class HeldChunkRead(JetStreamContext):
    """A JetStream context that holds back its first read of an adapter's chunks until
    ``release``: the replica has read the object's metadata, not yet its chunks."""

    def __init__(self, nc) -> None:
        super().__init__(nc)
        self.held = asyncio.Event()
        self.release = asyncio.Event()

    async def get_msg(self, stream_name: str, seq=None, subject=None, direct=False, next=False):
        if (subject or "").startswith(CHUNKS):
            await self._hold()
        return await super().get_msg(stream_name, seq, subject, direct, next)

    async def subscribe(self, subject: str, *args, **kwargs):
        if subject.startswith(CHUNKS):  # how nats-py's ObjectStore.get reads them
            await self._hold()
        return await super().subscribe(subject, *args, **kwargs)

    async def _hold(self) -> None:
        if not self.held.is_set():
            self.held.set()
            await self.release.wait()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def save(js, tmp_path, step: int) -> None:
    uri, data = write_adapter(tmp_path, step, size=50_000)
    await publish_event(js, SAVED, saved_event(uri, data, step))


async def health(state: ServingState) -> httpx.Response:
    transport = httpx.ASGITransport(app=create_app(state))
    async with httpx.AsyncClient(transport=transport, base_url="http://replica") as http:
        return await http.get("/health")


@contextlib.asynccontextmanager
async def publishing(nc, database_url: str, keep_latest: int):
    """The publisher as its service runs it, with retention keeping ``keep_latest`` steps."""
    settings = PublisherSettings(keep_latest=keep_latest, best_metric="none", fetch_timeout_s=0.05)
    publisher = Publisher(nc, database_url, settings)
    await publisher.start()
    task = asyncio.create_task(publisher.run())
    try:
        yield publisher
    finally:
        publisher.stop()
        await asyncio.wait_for(task, 10)
        await publisher.close()


@contextlib.asynccontextmanager
async def following(watcher: CheckpointWatcher):
    await watcher.start()
    try:
        yield watcher
    finally:
        await asyncio.wait_for(watcher.stop(), 10)


async def test_an_adapter_deleted_after_its_metadata_was_read_fails_at_once_leaving_no_consumer(js, tmp_path):
    name = object_name(PROJECT, MODEL, 1)
    _, data = write_adapter(tmp_path, 1)
    await put_adapter(js, name, data)
    info = await adapter_info(js, name)
    await (await js.object_store(subjects.ADAPTERS_BUCKET)).delete(name)  # retention, in between

    with pytest.raises(AdapterNotFound, match="deleted while it was read"):
        # nats-py's ObjectStore.get, given this info, waited here forever on an ordered consumer.
        await asyncio.wait_for(read_adapter(js, info), 5)
    assert (await js.stream_info(OBJECTS)).state.consumer_count == 0


async def test_with_retention_keeping_one_the_replica_converges_on_the_newest_step(
    nc, js, database_url, tmp_path
):
    replica_js, engine, clock = HeldChunkRead(nc), SlowEngine(), Clock()
    announced: list[int] = []
    watcher = CheckpointWatcher(
        replica_js,
        PROJECT,
        MODEL,
        engine,
        lambda step, name: announced.append(step),
        cache_dir=tmp_path / "cache",
        max_lag_s=MAX_LAG_S,
        clock=clock,
    )
    state = ServingState(engine, MODEL, checkpoint_lag=watcher.lag)
    async with publishing(nc, database_url, keep_latest=1), following(watcher):
        await save(js, tmp_path, 1)
        await replica_js.held.wait()  # step 1's metadata is read, its chunks are next...
        await save(js, tmp_path, 2)  # ...and retention deletes step 1 as step 2 is published
        await wait_for(lambda: gone(js, 1))
        replica_js.release.set()

        await engine.loading.wait()  # step 2 is loading (step 1 was skipped, not waited for)
        assert engine.started == [f"{MODEL}@2"]
        for step in (3, 4, 5):  # faster than the replica loads: each deletes the one before
            await save(js, tmp_path, step)
        await wait_for(lambda: gone(js, 4))
        await until(lambda: watcher.newest_step == 5)

        assert watcher.lag() is None  # behind, but not for longer than the bound yet
        assert (await health(state)).json()["status"] == "ok"
        clock.now += MAX_LAG_S + 1
        assert watcher.lag() == CheckpointLag(newest_step=5, served_step=0, behind_s=MAX_LAG_S + 1)
        response = await health(state)
        assert response.status_code == 503
        assert response.json() == {
            "status": "lagging",
            "newest_step": 5,
            "served_step": 0,
            "behind_s": MAX_LAG_S + 1,
            "adapters": [],
        }

        engine.finish_loads.set()
        await until(lambda: engine.adapters() == [f"{MODEL}@5"])
        assert engine.started == [f"{MODEL}@2", f"{MODEL}@5"]  # 3 and 4 were deleted: never loaded
        assert announced == [2, 5]
        assert watcher.lag() is None
        response = await health(state)
        assert response.status_code == 200 and response.json()["status"] == "ok"
        assert (await js.stream_info(OBJECTS)).state.consumer_count == 0


async def test_steps_published_during_a_load_are_skipped_for_the_newest(nc, js, database_url, tmp_path):
    engine = SlowEngine()
    watcher = CheckpointWatcher(js, PROJECT, MODEL, engine, lambda step, name: None, cache_dir=tmp_path)
    # Retention keeps every step here: 2 and 3 are skipped because 4 is newer, not because they are gone.
    async with publishing(nc, database_url, keep_latest=10), following(watcher):
        await save(js, tmp_path, 1)
        await engine.loading.wait()
        for step in (2, 3, 4):
            await save(js, tmp_path, step)
        await until(lambda: watcher.newest_step == 4)
        engine.finish_loads.set()
        await until(lambda: engine.adapters() == [f"{MODEL}@1", f"{MODEL}@4"])
        assert engine.started == [f"{MODEL}@1", f"{MODEL}@4"]  # not 2 and 3 on the way


class SwallowsCancel(JetStreamContext):
    """A context whose checkpoint catch-up read, once ``hold`` is set, waits and then swallows
    the cancel that ends its wait, as nats-py's request can when a cancel meets its reply."""

    def __init__(self, nc) -> None:
        super().__init__(nc)
        self.hold = False
        self.holding = asyncio.Event()

    async def get_last_msg(self, stream_name: str, subject: str, direct: bool | None = False):
        if self.hold and stream_name == subjects.CHECKPOINTS.name:
            self.holding.set()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.Event().wait()
        return await super().get_last_msg(stream_name, subject, direct)


async def test_stop_ends_the_watcher_even_when_a_request_swallows_its_cancel(nc, tmp_path):
    replica_js = SwallowsCancel(nc)
    watcher = CheckpointWatcher(
        replica_js, PROJECT, MODEL, SlowEngine(), lambda step, name: None, cache_dir=tmp_path, catch_up_s=0.05
    )
    await watcher.start()
    replica_js.hold = True
    await replica_js.holding.wait()  # a periodic catch-up is in its request
    await asyncio.wait_for(watcher.stop(), 10)


async def gone(js, step: int) -> bool:
    return not await object_exists(js, object_name(PROJECT, MODEL, step))


async def until(condition) -> None:
    """Wait for a condition on this process's own objects (the watcher's, the engine's)."""

    async def check() -> bool:
        return condition()

    await wait_for(check)


async def test_a_replica_started_after_a_step_is_caught_up_before_it_says_ready(
    nc, js, database_url, tmp_path
):
    """What ``main`` waits on before the ``ready`` line: the step published before the replica
    started is loaded, so a client routed to the new replica at once finds it served."""
    engine = SlowEngine()
    async with publishing(nc, database_url, keep_latest=10):
        await save(js, tmp_path, 1)
        # Read back from the stream, where the replica's catch-up reads it: a plain subscription
        # can hear the publish before the stream has stored it, and the catch-up then finds none.
        published = await js.subscribe(
            subjects.checkpoint("published", PROJECT, MODEL), ordered_consumer=True
        )
        await published.next_msg(timeout=30)
        await published.unsubscribe()
        watcher = CheckpointWatcher(js, PROJECT, MODEL, engine, lambda step, name: None, cache_dir=tmp_path)
        async with following(watcher):
            assert watcher.newest_step == 1  # read by the first catch-up, inside start()
            assert not await watcher.caught_up(0.2)  # the engine holds the load: not yet
            engine.finish_loads.set()
            assert await watcher.caught_up(30)
            assert engine.adapters() == [f"{MODEL}@1"]
            assert f"{MODEL}@1" in watcher.loaded
