"""The collector: trajectory groups in from JetStream, rows into PostgreSQL, ``group.ready`` out.

Order matters for exactly-once storage: rows are committed, then ``group.ready`` is published
(its id derived from the group id, so JetStream drops a repeat), then the message is acked. A
crash anywhere in between redelivers the message, and every step is a no-op the second time.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import asyncpg
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from artery.schemas import GroupReady, TrajectoryGroupSubmitted
from artery.services.collector.settings import CollectorSettings
from artery.services.collector.store import StoredGroup, write_groups
from artery.services.collector.validate import decode_group
from artery.shared import subjects
from artery.shared.bus import derived_id, prepare, publish_prepared
from artery.shared.consumer import ConsumerOptions, ConsumingService, DurableConsumer
from artery.shared.db import ServicePool
from artery.shared.errors import DependencyUnavailable, InvalidMessage
from artery.shared.logs import get_logger
from artery.shared.metrics import INGESTED_GROUPS, INGESTED_TRAJECTORIES
from artery.shared.subscriber import Delivery, Subscriber

log = get_logger(__name__)
SERVICE = "collector"
_READY_NAMESPACE = uuid.UUID("0d3c7f55-2a5e-4b1e-8f3a-726561647921")


def ready_event_id(project: str, model: str, group_id: str) -> str:
    """Derived from the group's key, so a redelivery announces under the same id."""
    return derived_id(_READY_NAMESPACE, project, model, group_id)


class Collector(ConsumingService):
    def __init__(self, js: JetStreamContext, dsn: str, settings: CollectorSettings):
        self.js = js
        self.dsn = dsn
        self.settings = settings
        self.db = ServicePool(dsn, max_size=settings.db_pool_size)
        # The subject check is the validator's (``decode_group``), among the others it makes.
        self.subscriber: Subscriber[TrajectoryGroupSubmitted] = Subscriber(
            TrajectoryGroupSubmitted, service=SERVICE, span="collector.store_group", decode=self.decode
        )
        # ``concurrency`` fetch loops on the same durable consumer, each with its own batch (as
        # replicas would be): while one batch waits for PostgreSQL, the next one is decoded.
        self.consumers = [
            DurableConsumer(
                js,
                service=SERVICE,
                stream=subjects.TRAJECTORIES,
                durable=subjects.COLLECTOR_CONSUMER,
                filter_subject=subjects.TRAJECTORIES.subjects[0],
                handler=self.subscriber.batched(self.handle_batch, keep=_compact),
                options=ConsumerOptions.from_settings(settings),
            )
            for _ in range(settings.concurrency)
        ]

    def decode(self, msg: Msg) -> TrajectoryGroupSubmitted:
        """The group, checked against its subject, headers and the size limits (``validate``)."""
        return decode_group(
            msg.subject,
            msg.data,
            msg.headers,
            max_bytes=self.settings.max_group_bytes,
            max_trajectories=self.settings.max_trajectories,
        )

    async def handle_batch(self, items: list[tuple[StoredGroup, Delivery]]) -> list[BaseException | None]:
        """The batch's valid groups (the subscriber dead-letters the others), in one transaction."""
        outcomes: list[BaseException | None] = [None] * len(items)
        valid = [(i, group) for i, (group, _) in enumerate(items)]
        try:
            valid = await self._store_isolating(valid, outcomes)
            await self._announce([ctx for _, ctx in items], valid)
            for _, item in valid:
                INGESTED_GROUPS.labels(item.project, item.model).inc()
                INGESTED_TRAJECTORIES.labels(item.project, item.model).inc(len(item.rewards))
        except DependencyUnavailable as exc:
            for i, _ in valid:
                outcomes[i] = exc
        return outcomes

    async def _store_isolating(self, valid: list[tuple[int, StoredGroup]], outcomes: list) -> list:
        """Store the batch; if PostgreSQL rejects its content, store each group alone so that
        only the group it rejects is dead-lettered (with PostgreSQL's reason), not its batch mates.
        Return the groups that are stored (now or before): those to announce."""
        try:
            return self._without_conflicts(valid, await self._store([item for _, item in valid]), outcomes)
        except asyncpg.exceptions.DataError:
            pass
        stored = []
        for i, item in valid:
            try:
                stored += self._without_conflicts([(i, item)], await self._store([item]), outcomes)
            except asyncpg.exceptions.DataError as exc:
                outcomes[i] = InvalidMessage(
                    "storage", f"PostgreSQL rejected the group: {exc}", original_id=item.id
                )
        return stored

    @staticmethod
    def _without_conflicts(
        valid: list[tuple[int, StoredGroup]], conflicts: dict[int, str], outcomes: list
    ) -> list[tuple[int, StoredGroup]]:
        """A different group under a stored group's id is a dead letter, never dropped in silence."""
        for position, stored_sha256 in conflicts.items():
            i, item = valid[position]
            log.warning("conflicting group", group_id=item.id, project=item.project, model=item.model)
            outcomes[i] = InvalidMessage(
                "conflict",
                f"{item.project}/{item.model} already has a different group {item.id!r}: stored body"
                f" sha256 {stored_sha256}, this one {item.body_sha256}",
                original_id=item.id,
            )
        return [entry for position, entry in enumerate(valid) if position not in conflicts]

    async def _store(self, batch: list[StoredGroup]) -> dict[int, str]:
        async with self.db.connection() as conn:
            return await write_groups(conn, batch)

    async def _announce(self, deliveries: Sequence[Delivery], valid: list[tuple[int, StoredGroup]]) -> None:
        """Publish one ``group.ready`` per stored group, each in its submission's trace."""
        items = []
        for i, g in valid:
            ready = GroupReady(
                id=ready_event_id(g.project, g.model, g.id),
                project=g.project,
                model=g.model,
                step=g.step,
                group_id=g.id,
                split=g.split,
                num_trajectories=len(g.bodies),
                rewards=g.rewards,
                needs_reward=g.needs_reward,
                stream_seq=g.stream_seq,
            )
            attributes = {"artery.group_id": g.id, "artery.project": g.project, "artery.model": g.model}
            with self.subscriber.span(deliveries[i], attributes):
                items.append(prepare(subjects.group_ready(g.project, g.model), ready))
        try:
            await publish_prepared(self.js, items)
        except Exception as exc:  # rows are committed; the redelivery will announce again
            raise DependencyUnavailable(f"publishing group.ready failed: {exc!r}") from exc


def _compact(group: TrajectoryGroupSubmitted, ctx: Delivery) -> StoredGroup:
    """Only the compact record outlives the group's decoding (see StoredGroup)."""
    return StoredGroup.of(group, ctx.stream_seq, ctx.msg.data)
