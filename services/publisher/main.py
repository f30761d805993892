"""Entry point: ``python -m artery.services.publisher``. Settings are validated before connecting."""

from __future__ import annotations

import asyncio

from artery.services.publisher.base_models import BaseModelPolicy
from artery.services.publisher.control import RetentionServer
from artery.services.publisher.registry import RegistryServer
from artery.services.publisher.service import Publisher
from artery.services.publisher.settings import PREFIX, PublisherSettings
from artery.shared.auth import nats_connect_options
from artery.shared.runtime import run_service
from artery.shared.service_runner import serve_consumers
from artery.shared.settings import CommonSettings, load


async def start(common: CommonSettings, stop: asyncio.Event) -> None:
    settings = load(PublisherSettings, PREFIX)
    policy = BaseModelPolicy.parse(
        settings.base_models, settings.warm_start_dir, authenticated=authenticated(common)
    )
    await serve_consumers(
        "publisher",
        common,
        stop,
        lambda nc, dsn: Publisher(nc, dsn, settings),
        companions=lambda nc, publisher: [RetentionServer(nc, publisher), RegistryServer(nc, policy)],
    )


def authenticated(common: CommonSettings) -> bool:
    """Whether the bus checks who connects: then an allow-list of base models protects something."""
    options = nats_connect_options(common)
    credentials = {"user", "token", "user_credentials"} & options.keys()
    return bool(credentials) or any("@" in url for url in common.nats_url.split(","))


def main() -> None:
    run_service("publisher", start)


if __name__ == "__main__":
    main()
