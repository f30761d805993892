"""Backends: where a model's groups go and where its step is read.

``Backend(nats_url=...)`` joins a running Artery (``artery up`` or docker compose);
``LocalBackend()`` first starts the embedded stack (NATS, PostgreSQL, every service) as child
processes, like ART's ``LocalBackend``. Both have the same API.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import nats
from nats.js.errors import KeyNotFoundError

from artery.schemas import ModelRecord, utcnow
from artery.shared import bus, subjects
from artery.shared.settings import CommonSettings
from artery.stack import Stack
from artery.trajectories import TrajectoryGroup

if TYPE_CHECKING:
    from artery.model import Model

_record_decoder = msgspec.json.Decoder(ModelRecord)


class Backend:
    """A connection to a running Artery over NATS."""

    def __init__(self, nats_url: str | None = None, *, nats_creds: str | None = None):
        self.settings = CommonSettings(
            nats_url=nats_url or os.environ.get("ARTERY_NATS_URL", CommonSettings.nats_url),
            nats_creds=nats_creds or os.environ.get("ARTERY_NATS_CREDS") or None,
        )
        self._nc: nats.NATS | None = None
        self._lock = asyncio.Lock()

    async def _connect(self) -> nats.NATS:
        async with self._lock:
            if self._nc is None or self._nc.is_closed:
                self._nc = await bus.connect(self.settings, name="artery-sdk")
                await bus.provision(self._nc.jetstream(), self.settings)
            return self._nc

    async def _js(self):
        return (await self._connect()).jetstream()

    async def _models_kv(self):
        return await (await self._js()).key_value(subjects.MODELS_BUCKET)

    async def register(self, model: Model) -> None:
        """Record the model in the registry; a re-registration keeps its current step."""
        kv = await self._models_kv()
        key = subjects.model_key(model.project, model.name)
        step = 0
        try:
            step = _record_decoder.decode((await kv.get(key)).value).step
        except KeyNotFoundError:
            pass
        record = ModelRecord(
            project=model.project,
            name=model.name,
            base_model=getattr(model, "base_model", None),
            trainable=model.trainable,
            config=model.config or {},
            step=step,
            registered_at=utcnow(),
        )
        await kv.put(key, msgspec.json.encode(record))

    async def _get_step(self, model: Model) -> int:
        kv = await self._models_kv()
        try:
            entry = await kv.get(subjects.model_key(model.project, model.name))
        except KeyNotFoundError:
            return 0
        return _record_decoder.decode(entry.value).step

    async def publish(
        self, model: Model, groups: Iterable[TrajectoryGroup], *, split: str = "train"
    ) -> list[str]:
        """Publish groups durably (the stream has them when this returns); return their ids."""
        step = await self._get_step(model) if model.trainable else None
        events = [g.to_event(project=model.project, model=model.name, step=step, split=split) for g in groups]
        js = await self._js()
        await bus.publish_events(js, [(subjects.trajectories(e.project, e.model), e) for e in events])
        return [e.id for e in events]

    async def close(self) -> None:
        if self._nc is not None and not self._nc.is_closed:
            await bus.close(self._nc)
        self._nc = None

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


class LocalBackend(Backend):
    """Starts the embedded stack under ``path`` (default ``./.artery``) and connects to it."""

    def __init__(self, *, path: str | os.PathLike = ".artery", services: tuple[str, ...] | None = None):
        super().__init__(nats_url="nats://127.0.0.1:0")
        self.path = Path(path)
        self.stack = Stack(home=self.path / "stack", **({"services": services} if services else {}))
        self._started = False

    async def _connect(self) -> nats.NATS:
        if not self._started:
            # Starting servers blocks for about a second: keep the event loop free meanwhile.
            await asyncio.to_thread(self.stack.start)
            self.settings = msgspec.structs.replace(self.settings, nats_url=self.stack.nats_url)
            self._started = True
        return await super()._connect()

    @property
    def database_url(self) -> str | None:
        return self.stack.database_url

    async def close(self) -> None:
        await super().close()
        if self._started:
            await asyncio.to_thread(self.stack.stop)
            self._started = False
