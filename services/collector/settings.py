"""Collector settings, read from ``ARTERY_COLLECTOR_*`` (plus the common ``ARTERY_*``)."""

from __future__ import annotations

from typing import Annotated

import msgspec

from artery.shared.settings import doc

PREFIX = "ARTERY_COLLECTOR_"


class CollectorSettings(msgspec.Struct, kw_only=True, frozen=True):
    batch_size: Annotated[int, doc("messages fetched and written per transaction", ge=1, le=5000)] = 500
    fetch_timeout_s: Annotated[float, doc("longest wait for a batch to fill", gt=0)] = 0.2
    max_group_bytes: Annotated[
        int, doc("largest trajectory group accepted; larger ones are dead-lettered", ge=1024)
    ] = 8 * 1024 * 1024
    max_trajectories: Annotated[int, doc("most trajectories in one group", ge=1)] = 1024
    max_deliveries: Annotated[
        int, doc("deliveries of a message that keeps failing before it is dead-lettered", ge=1)
    ] = 20
    ack_wait_s: Annotated[float, doc("time to commit a batch before redelivery", gt=0)] = 30.0
    backoff_max_s: Annotated[float, doc("longest pause while PostgreSQL is down", gt=0)] = 10.0
    db_pool_size: Annotated[int, doc("PostgreSQL connections", ge=1, le=64)] = 2
    concurrency: Annotated[
        int,
        doc(
            "batches handled at once, each on its own connection (one is decoded while another is written)",
            ge=1,
            le=16,
        ),
    ] = 2
