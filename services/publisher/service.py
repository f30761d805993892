"""The checkpoint publisher: ``checkpoint.saved`` in, adapter into the Object Store, row into
PostgreSQL, ``checkpoint.published`` out, then retention.

The trainer and the publisher share no disk: the trainer puts each step's
``shared.adapters.pack_adapter(adapter_dir)`` in the trainer-state store and announces it as
``nats-object://artery_trainer_state/<project>.<model>/<step:06d>/adapter.tar`` with the sha256 of
exactly those bytes (``files.locate`` refuses any other bucket, and another model's or step's
object). A ``file://`` URI on a filesystem both see is still read: an older trainer's events may be
waiting in the stream. The publisher's copy in the adapters bucket is what replicas fetch, and
what retention deletes; the trainer keeps its own for its newest steps only
(``services.trainer.announce``).

Order makes every step safe to repeat, so a redelivery (or a crash anywhere) changes nothing:
1. look the event up in PostgreSQL: a row means the adapter is already stored, so the file is
   not read again (the trainer may have pruned it, or retention the object);
2. read and verify the archive, put it under ``<project>/<model>/<step:06d>`` (skipped when an
   object with that digest is there), insert the row (ON CONFLICT DO NOTHING);
3. publish ``checkpoint.published`` (id derived from the saved event id, so JetStream drops a
   repeat) unless the row says it went out, then record that it did;
4. apply retention: under a per-model advisory lock, for each step to delete, delete the object
   (already gone is fine), publish ``checkpoint.deleted`` (id derived from that step's saved
   event id), then set ``deleted_at``.
"""

from __future__ import annotations

import uuid

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.errors import NotFoundError

from artery.schemas import CheckpointDeleted, CheckpointPublished, CheckpointSaved, Event
from artery.services.publisher import files, store
from artery.services.publisher.retention import Checkpoint, RetentionPlan, RetentionPolicy, plan_retention
from artery.services.publisher.settings import PublisherSettings
from artery.services.publisher.store import CheckpointRow
from artery.shared import subjects
from artery.shared.adapters import put_adapter
from artery.shared.bus import publish_event
from artery.shared.consumer import ConsumerOptions, ConsumingService, DurableConsumer
from artery.shared.db import ServicePool
from artery.shared.errors import DependencyUnavailable, InvalidMessage
from artery.shared.logs import get_logger
from artery.shared.served_name import served_name
from artery.shared.subscriber import Delivery, Subscriber

log = get_logger(__name__)
SERVICE = "publisher"
_PUBLISHED_NAMESPACE = uuid.UUID("8a4f2c1e-7b3d-4f6a-9e5c-7075626c6973")
_DELETED_NAMESPACE = uuid.UUID("8a4f2c1e-7b3d-4f6a-9e5c-64656c657465")


def object_name(project: str, model: str, step: int) -> str:
    return f"{project}/{model}/{step:06d}"


def published_event_id(saved_id: str) -> str:
    return str(uuid.uuid5(_PUBLISHED_NAMESPACE, saved_id))


def deleted_event_id(saved_id: str) -> str:
    return str(uuid.uuid5(_DELETED_NAMESPACE, saved_id))


class Publisher(ConsumingService):
    def __init__(self, nc: NATS, dsn: str, settings: PublisherSettings):
        self.nc = nc
        self.js = nc.jetstream()
        self.settings = settings
        self.policy = settings.retention_policy()
        self.db = ServicePool(dsn, max_size=settings.db_pool_size)
        self.subscriber: Subscriber[CheckpointSaved] = Subscriber(
            CheckpointSaved,
            service=SERVICE,
            span="publisher.publish_checkpoint",
            subject=lambda saved: subjects.checkpoint("saved", saved.project, saved.model),
            attributes=lambda saved: {
                "artery.project": saved.project,
                "artery.model": saved.model,
                "artery.step": saved.step,
            },
        )
        self.consumers = [
            DurableConsumer(
                self.js,
                service=SERVICE,
                stream=subjects.CHECKPOINTS,
                durable=subjects.PUBLISHER_CONSUMER,
                filter_subject=subjects.CHECKPOINTS_SAVED,
                handler=self.subscriber.one_at_a_time(self.handle),
                options=ConsumerOptions.from_settings(settings),
            )
        ]

    async def handle(self, saved: CheckpointSaved, ctx: Delivery) -> None:
        """One ``checkpoint.saved``, in the span that continues the trainer's step: what it
        publishes (``checkpoint.published``) carries the trace on to every inference replica."""
        await self.publish_checkpoint(saved, ctx.msg)

    async def publish_checkpoint(self, saved: CheckpointSaved, msg: Msg | None = None) -> None:
        if saved.step is None:
            raise InvalidMessage("validation", "checkpoint.saved needs a step")
        where = files.locate(saved)
        async with self.db.connection() as conn:
            row = _same_event(saved, await store.find(conn, saved.project, saved.model, saved.step, saved.id))
        if row is None:
            data = await files.fetch_adapter(self.js, where, saved.sha256, saved.size_bytes)
            if msg is not None:
                await msg.in_progress()  # a large adapter may take a while to put
            row = CheckpointRow(
                project=saved.project,
                model=saved.model,
                step=saved.step,
                event_id=saved.id,
                object_name=object_name(saved.project, saved.model, saved.step),
                sha256=saved.sha256,
                size_bytes=len(data),
                base_model=saved.base_model,
                metrics=dict(saved.metrics),
                saved_at=saved.time,
            )
            await self._put_object(row.object_name, data, row.sha256)
            del data
            async with self.db.connection() as conn:
                if not await store.insert(conn, row):  # another replica got there first
                    found = await store.find(conn, saved.project, saved.model, saved.step, saved.id)
                    row = _same_event(saved, found)
        if row is None or row.event_id != saved.id:
            log.info("duplicate checkpoint.saved; nothing to do", step=saved.step, event_id=saved.id)
            return
        if row.published_at is None and row.deleted_at is None:
            await self._publish(
                subjects.checkpoint("published", row.project, row.model), published_event(row)
            )
            async with self.db.connection() as conn:
                await store.mark_published(conn, row.project, row.model, row.step)
            log.info("published", project=row.project, model=row.model, step=row.step)
        await self.apply_retention(row.project, row.model, self.policy, reason="retention")

    async def apply_retention(
        self, project: str, model: str, policy: RetentionPolicy, *, reason: str
    ) -> RetentionPlan:
        """Delete what ``policy`` does not keep; returns the plan (``delete``: deleted now)."""
        async with self.db.connection() as conn, conn.transaction():
            await store.lock_model(conn, project, model)
            rows = {r.step: r for r in await store.live(conn, project, model)}
            plan = plan_retention([Checkpoint(r.step, r.metrics) for r in rows.values()], policy)
            for step in plan.delete:
                row = rows[step]
                await self._delete_object(row.object_name)
                deleted = CheckpointDeleted(
                    id=deleted_event_id(row.event_id),
                    project=project,
                    model=model,
                    step=step,
                    object_name=row.object_name,
                    reason=reason,
                )
                await self._publish(subjects.checkpoint("deleted", project, model), deleted)
                await store.mark_deleted(conn, project, model, step, reason)
        if plan.delete:
            log.info("retention", project=project, model=model, kept=plan.keep, deleted=plan.delete)
        return plan

    async def _put_object(self, name: str, data: bytes, sha256: str) -> None:
        try:
            await put_adapter(self.js, name, data, sha256=sha256)  # same bytes there: nothing written
        except Exception as exc:
            raise DependencyUnavailable(f"Object Store put of {name!r} failed: {exc!r}") from exc

    async def _delete_object(self, name: str) -> None:
        try:
            bucket = await self.js.object_store(subjects.ADAPTERS_BUCKET)
            await bucket.delete(name)
        except NotFoundError:  # deleted before a crash (ObjectNotFoundError is a NotFoundError)
            pass
        except Exception as exc:
            raise DependencyUnavailable(f"Object Store delete of {name!r} failed: {exc!r}") from exc

    async def _publish(self, subject: str, event: Event) -> None:
        try:
            await publish_event(self.js, subject, event)
        except Exception as exc:
            raise DependencyUnavailable(f"publishing {subject} failed: {exc!r}") from exc


def published_event(row: CheckpointRow) -> CheckpointPublished:
    return CheckpointPublished(
        id=published_event_id(row.event_id),
        project=row.project,
        model=row.model,
        step=row.step,
        object_name=row.object_name,
        sha256=row.sha256,
        size_bytes=row.size_bytes,
        base_model=row.base_model,
        served_name=served_name(row.model, row.step),
    )


def _same_event(saved: CheckpointSaved, rows: list[CheckpointRow]) -> CheckpointRow | None:
    """The row ``saved`` wrote, if any. Another event for the same bytes at the same step is a
    harmless duplicate (returned, and left alone by the caller); anything else is a conflict."""
    here = (saved.project, saved.model, saved.step)
    for row in rows:
        if row.event_id == saved.id and (row.project, row.model, row.step) != here:
            raise InvalidMessage(
                "id_conflict", f"event id {saved.id} already saved {row.project}/{row.model} step {row.step}"
            )
        if row.event_id != saved.id and row.sha256 != saved.sha256:
            raise InvalidMessage(
                "step_conflict",
                f"step {saved.step} of {saved.project}/{saved.model} is already published with "
                f"sha256 {row.sha256} (event {row.event_id})",
            )
    return next((r for r in rows if r.event_id == saved.id), rows[0] if rows else None)
