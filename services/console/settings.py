"""Console settings, read with prefix ``ARTERY_CONSOLE_``."""

from __future__ import annotations

from typing import Annotated

import msgspec

from artery.shared.settings import doc

PREFIX = "ARTERY_CONSOLE_"


class ConsoleSettings(msgspec.Struct, kw_only=True, frozen=True):
    host: Annotated[str, doc("address the console listens on")] = "127.0.0.1"
    port: Annotated[
        int, doc("HTTP port of the console; 0 picks a free one (logged as url)", ge=0, le=65535)
    ] = 0
    dead_letters: Annotated[int, doc("most recent dead letters shown", ge=1, le=10_000)] = 200
    page_size: Annotated[int, doc("trajectories per page of the browser", ge=1, le=1000)] = 50
    admin_user: Annotated[
        str, doc("the NATS user whose credential the actions (re-publish, resume) take")
    ] = "admin"
