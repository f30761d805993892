"""Entry point: ``python -m artery.services.trainer``. Settings are validated before connecting,
and before torch is imported (seconds): a wrong setting is said at once."""

from __future__ import annotations

import asyncio
import os

import msgspec
import structlog

from artery.services.trainer.base_models import ANY, EMBEDDED
from artery.services.trainer.settings import PREFIX, TrainerSettings, worker_id
from artery.shared.auth import nats_connect_options
from artery.shared.models import limit_torch_threads
from artery.shared.runtime import INSTANCE_ID, run_service
from artery.shared.service_runner import serve_consumers
from artery.shared.settings import CommonSettings, load


async def start(common: CommonSettings, stop: asyncio.Event) -> None:
    settings = load(TrainerSettings, PREFIX)
    if settings.base_models is None:
        allowed = ",".join(EMBEDDED) if authenticated(common) else ANY
        settings = msgspec.structs.replace(settings, base_models=allowed)
    limit_torch_threads(settings.torch_threads)
    # The settings are valid: now the training stack (torch, transformers) may load.
    from artery.services.trainer.lease import Holder
    from artery.services.trainer.service import Trainer

    # What this process's NATS service ping answers with (shared.runtime): how the pool tells
    # whether the holder of a model's lease still runs.
    holder = Holder(
        worker=worker_id(settings),
        instance=INSTANCE_ID,
        pid=str(os.getpid()),
        metrics_url=structlog.contextvars.get_contextvars().get("metrics_url") or "",
    )
    await serve_consumers(
        "trainer",
        common,
        stop,
        lambda nc, dsn: Trainer(nc, dsn, settings, holder=holder),
        checkpoint_dir=settings.checkpoint_dir,
        device=settings.device,
        worker_id=holder.worker,
    )


def authenticated(common: CommonSettings) -> bool:
    """Whether the bus checks who connects: then an allow-list of base models protects something
    (the publisher's rule, ``services/publisher/main.py``)."""
    options = nats_connect_options(common)
    credentials = {"user", "token", "user_credentials"} & options.keys()
    return bool(credentials) or any("@" in url for url in common.nats_url.split(","))


def main() -> None:
    run_service("trainer", start)


if __name__ == "__main__":
    main()
