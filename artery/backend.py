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
from artery.shared.control_client import live_replicas
from artery.shared.settings import CommonSettings
from artery.stack import Stack
from artery.trajectories import TrajectoryGroup

if TYPE_CHECKING:
    from artery.model import Model

_record_decoder = msgspec.json.Decoder(ModelRecord)


class Backend:
    """A connection to a running Artery over NATS."""

    def __init__(
        self,
        nats_url: str | None = None,
        *,
        nats_creds: str | None = None,
        inference_url: str | None = None,
        inference_api_key: str | None = None,
    ):
        self.settings = CommonSettings(
            nats_url=nats_url or os.environ.get("ARTERY_NATS_URL", CommonSettings.nats_url),
            nats_creds=nats_creds or os.environ.get("ARTERY_NATS_CREDS") or None,
        )
        #: An OpenAI-compatible base URL (``http://host:port/v1``); unset: found in the registry.
        self.inference_url = inference_url or os.environ.get("ARTERY_INFERENCE_URL") or None
        self.inference_api_key = inference_api_key or os.environ.get("ARTERY_INFERENCE_API_KEY") or None
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

    async def _inference_url(self, model: Model, timeout_s: float = 0.0) -> str | None:
        """The given URL, or the first live replica serving this model (waiting up to ``timeout_s``)."""
        if self.inference_url:
            return self.inference_url
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            replicas = await live_replicas(await self._js(), model.project, model.name)
            if replicas:
                return f"{sorted(replicas, key=lambda r: r.replica_id)[0].url}/v1"
            if asyncio.get_running_loop().time() > deadline:
                return None
            await asyncio.sleep(0.2)

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

    def __init__(
        self,
        *,
        path: str | os.PathLike = ".artery",
        services: tuple[str, ...] | None = None,
        start_inference: bool = True,
        inference_env: dict[str, str] | None = None,
    ):
        super().__init__(nats_url="nats://127.0.0.1:0")
        self.path = Path(path)
        self.stack = Stack(home=self.path / "stack", **({"services": services} if services else {}))
        #: Extra ``ARTERY_INFERENCE_*`` settings for the replicas it starts (engine, device...).
        self.inference_env = dict(inference_env or {})
        self.start_inference = start_inference
        self._started = False

    async def _connect(self) -> nats.NATS:
        if not self._started:
            # Starting servers blocks for about a second: keep the event loop free meanwhile.
            await asyncio.to_thread(self.stack.start)
            self.settings = msgspec.structs.replace(self.settings, nats_url=self.stack.nats_url)
            self._started = True
        return await super()._connect()

    async def _inference_url(self, model: Model, timeout_s: float = 180.0) -> str | None:
        """Start this model's inference replica (once), then find it in the registry."""
        name = f"inference-{model.project}-{model.name}"
        if self.start_inference and name not in self.stack.processes:
            env = {
                "ARTERY_INFERENCE_PROJECT": model.project,
                "ARTERY_INFERENCE_MODEL": model.name,
                "ARTERY_INFERENCE_BASE_MODEL": model.base_model,
                "ARTERY_INFERENCE_REPLICA_ID": f"local-{model.project}-{model.name}",
                **self.inference_env,
            }
            process = self.stack.start_service(name, service="inference", env=env)
            await asyncio.to_thread(process.wait_ready, timeout_s)
        return await super()._inference_url(model, timeout_s=timeout_s)

    @property
    def database_url(self) -> str | None:
        return self.stack.database_url

    async def close(self) -> None:
        await super().close()
        if self._started:
            await asyncio.to_thread(self.stack.stop)
            self._started = False
