"""Publisher settings, read from ``ARTERY_PUBLISHER_*`` (plus the common ``ARTERY_*``)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from artery.services.publisher.retention import RetentionPolicy
from artery.shared.settings import doc

PREFIX = "ARTERY_PUBLISHER_"
#: The value of ``ARTERY_PUBLISHER_BEST_METRIC`` that turns "keep the best" off.
NO_METRIC = "none"


class PublisherSettings(msgspec.Struct, kw_only=True, frozen=True):
    keep_latest: Annotated[
        int, doc("newest checkpoints of a model kept after each publish (the latest always is)", ge=1)
    ] = 1
    best_metric: Annotated[
        str | None,
        doc(f"metric whose best step is also kept (from checkpoint.saved); '{NO_METRIC}' keeps no best"),
    ] = "reward_mean"
    best_mode: Annotated[Literal["max", "min"], doc("whether the best value is the highest or lowest")] = (
        "max"
    )
    batch_size: Annotated[int, doc("checkpoint.saved messages fetched at once", ge=1, le=100)] = 4
    fetch_timeout_s: Annotated[float, doc("longest wait for a batch to fill", gt=0)] = 1.0
    max_deliveries: Annotated[
        int, doc("deliveries of a message that keeps failing before it is dead-lettered", ge=1)
    ] = 20
    ack_wait_s: Annotated[float, doc("time to store one adapter before the message is redelivered", gt=0)] = (
        120.0
    )
    backoff_max_s: Annotated[float, doc("longest pause while a dependency is down", gt=0)] = 10.0
    db_pool_size: Annotated[int, doc("PostgreSQL connections", ge=1, le=16)] = 2
    base_models: Annotated[
        str | None,
        doc(
            "base models a model may be registered on: names, comma-separated; '*' accepts any name"
            " or path. Unset: '*' on a bus without authentication (whoever reaches it may write"
            " anything anyway), else the embedded models' names"
        ),
    ] = None
    warm_start_dir: Annotated[
        str | None,
        doc(
            "directory of adapters a project may warm-start from, <dir>/<project>/<adapter>;"
            " unset: no warm starts where base models are restricted"
        ),
    ] = None

    def retention_policy(self) -> RetentionPolicy:
        metric = self.best_metric
        if metric is not None and metric.strip().lower() in ("", NO_METRIC):
            metric = None
        return RetentionPolicy(keep_latest=self.keep_latest, best_metric=metric, best_mode=self.best_mode)
