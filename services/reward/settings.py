"""Reward service settings, read from ``ARTERY_REWARD_*`` (plus the common ``ARTERY_*``).

The judge's endpoint and key are the deployment's, never the group's: a group may choose the
rubric, and a judge model only from ``allowed_judges``, so it cannot make the service send the
key to an address (or a provider) of its choosing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import msgspec

from artery.shared.settings import doc

PREFIX = "ARTERY_REWARD_"


class RewardSettings(msgspec.Struct, kw_only=True, frozen=True):
    judge_model: Annotated[
        str, doc("litellm model of the judge when a group names none (provider/model, e.g. openai/o3)")
    ] = "openai/o3"
    judge_api_base: Annotated[
        str | None, doc("OpenAI-compatible base URL of the judge (e.g. Artery's own inference /v1)")
    ] = None
    judge_api_key: Annotated[str | None, doc("API key sent to the judge")] = None
    judge_api_key_file: Annotated[str | None, doc("file holding the judge's API key (docker secrets)")] = None
    allowed_judges: Annotated[
        str,
        doc(
            "comma-separated litellm models a group may name as its judge besides judge_model"
            " (exact names); a group naming another is dead-lettered as forbidden_judge"
        ),
    ] = ""
    judge_timeout_s: Annotated[float, doc("longest wait for one judge answer", gt=0)] = 120.0
    max_attempts: Annotated[int, doc("judge calls per group before it is dead-lettered", ge=1, le=10)] = 2
    judge_outage_max_deliveries: Annotated[
        int,
        doc(
            "deliveries of a group that find the judge unreachable (timeout, connection error, 5xx,"
            " rate limit) before it is dead-lettered as judge_unavailable; about backoff_max_s apart",
            ge=1,
        ),
    ] = 20
    concurrency: Annotated[int, doc("groups scored at the same time", ge=1, le=256)] = 8
    batch_size: Annotated[int, doc("group.ready messages fetched at once", ge=1, le=1000)] = 32
    fetch_timeout_s: Annotated[float, doc("longest wait for a batch to fill", gt=0)] = 1.0
    ack_wait_s: Annotated[float, doc("time to score a batch before it is redelivered", gt=0)] = 300.0
    max_deliveries: Annotated[
        int, doc("deliveries of a message that keeps failing before it is dead-lettered", ge=1)
    ] = 20
    backoff_max_s: Annotated[float, doc("longest pause while the judge or PostgreSQL is down", gt=0)] = 30.0
    db_pool_size: Annotated[int, doc("PostgreSQL connections", ge=1, le=32)] = 4

    def allowed_judge_models(self) -> frozenset[str]:
        """The judge models a group may name: the configured one and the allow-list."""
        listed = (name.strip() for name in self.allowed_judges.split(","))
        return frozenset({self.judge_model, *(name for name in listed if name)})

    def litellm_params(self) -> dict[str, object]:
        """Where and how litellm reaches the judge."""
        params: dict[str, object] = {"timeout": self.judge_timeout_s}
        if self.judge_api_base:
            params["api_base"] = self.judge_api_base
        key = self.judge_api_key
        if key is None and self.judge_api_key_file:
            key = Path(self.judge_api_key_file).read_text().strip()
        if key:
            params["api_key"] = key
        return params
