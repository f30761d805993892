"""Entry point: ``python -m artery.services.trainer``. Settings are validated before connecting."""

from __future__ import annotations

import asyncio
import os
import socket

from artery.services.trainer.service import Trainer
from artery.services.trainer.settings import PREFIX, TrainerSettings
from artery.shared import bus
from artery.shared.db import migrate_when_ready
from artery.shared.errors import ConfigError
from artery.shared.logs import get_logger
from artery.shared.models import limit_torch_threads
from artery.shared.runtime import connect_service, run_service
from artery.shared.settings import CommonSettings, load

log = get_logger(__name__)


async def start(common: CommonSettings, stop: asyncio.Event) -> None:
    settings = load(TrainerSettings, PREFIX)
    limit_torch_threads(settings.torch_threads)
    if not common.database_url:
        raise ConfigError("the trainer needs ARTERY_DATABASE_URL")
    nc = await connect_service("trainer", common)
    await migrate_when_ready(common.database_url)
    trainer = Trainer(
        nc, common.database_url, settings, trainer_id=f"trainer-{socket.gethostname()}-{os.getpid()}"
    )
    await trainer.start()
    log.info("ready", checkpoint_dir=settings.checkpoint_dir, device=settings.device)
    task = asyncio.create_task(trainer.run())
    await stop.wait()
    trainer.stop()
    await task
    await trainer.close()
    await bus.close(nc)


def main() -> None:
    run_service("trainer", start)


if __name__ == "__main__":
    main()
