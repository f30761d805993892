"""The pause around a step going wrong. A replica that died but is still registered (its
heartbeat not yet expired) cannot ack a pause: the trainer waits that out with back-off, never
dead-letters the request, and trains once the registry forgets the dead replica. A trainer
cancelled while the replicas resume ends only after the step's save has ended."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import msgspec

from artery.schemas import DeadLetter, ReplicaInfo, TrainCompleted, TrainRequested, new_event_id
from artery.services.collector.store import StoredGroup, write_groups
from artery.services.trainer.service import Trainer
from artery.services.trainer.settings import TrainerSettings
from artery.shared import subjects
from artery.shared.bus import publish_event
from artery.shared.models import TINY
from tests.factories import register_trainable
from tests.test_db_faults import MODEL, PROJECT, text_group
from tests.test_reward_service import read_stream


async def test_a_dead_registered_replica_delays_training_without_dead_lettering(
    js, nc, db, database_url, tmp_path
):
    await register_trainable(js, PROJECT, MODEL, TINY)
    replicas = await js.key_value(subjects.REPLICAS_BUCKET)
    ghost = ReplicaInfo(
        replica_id="ghost", project=PROJECT, model=MODEL, engine="transformers", url="http://x"
    )
    await replicas.put(
        subjects.replica_key(PROJECT, MODEL, "ghost"), msgspec.json.encode(ghost)
    )  # registered, but nobody answers
    groups = [text_group(seed) for seed in range(2)]
    await write_groups(db, [StoredGroup.of(g, None) for g in groups])

    trainer = Trainer(
        nc,
        database_url,
        TrainerSettings(checkpoint_dir=str(tmp_path / "ckpt"), max_seq_len=128, pause_timeout_s=0.3),
    )
    trainer.consumer.options.max_deliveries = 2  # a pause failure counted as a bug would dead-letter
    trainer.consumer.options.backoff_max_s = 0.5
    await trainer.start()
    task = asyncio.create_task(trainer.run())
    try:
        request = TrainRequested(
            id=new_event_id(), project=PROJECT, model=MODEL, group_ids=[g.id for g in groups]
        )
        await publish_event(js, subjects.train("requested", PROJECT, MODEL), request)
        for _ in range(200):  # until it was refused at least three times
            if trainer.consumer.stats.retried >= 3:
                break
            await asyncio.sleep(0.1)
        assert trainer.consumer.stats.retried >= 3
        await replicas.delete(subjects.replica_key(PROJECT, MODEL, "ghost"))  # it deregisters
        [completed] = await read_stream(
            js, subjects.train("completed", PROJECT, MODEL), TrainCompleted, 60, 1
        )
        assert completed.request_id == request.id and completed.step == 1
        assert await read_stream(js, subjects.dead_letter("trainer"), DeadLetter, 0.5, 1) == []
    finally:
        trainer.stop()
        await asyncio.wait_for(task, 30)
        await trainer.close()


async def test_a_step_cancelled_while_replicas_resume_ends_after_its_save(
    js, nc, db, database_url, tmp_path, monkeypatch
):
    """The save runs in a thread while the replicas resume. Cancelled there (the service
    stopping), the step used to end at once and leave the save running unobserved beside whatever
    came next; now it waits for the save to end, then the cancellation goes on."""
    from artery.services.trainer import step_files

    resuming = asyncio.Event()
    may_save = threading.Event()
    order: list[str] = []
    real_snapshot_step = step_files.snapshot_step

    def save_when_allowed(*args, **kwargs):
        may_save.wait(60)
        files = real_snapshot_step(*args, **kwargs)
        order.append("saved")
        return files

    @contextlib.asynccontextmanager
    async def resume_that_hangs(self, request):
        yield None
        resuming.set()
        await asyncio.Event().wait()  # the resume request never answered

    monkeypatch.setattr(step_files, "snapshot_step", save_when_allowed)
    monkeypatch.setattr(Trainer, "_hold_inference", resume_that_hangs)
    await register_trainable(js, PROJECT, MODEL, TINY)
    groups = [text_group(seed) for seed in range(2)]
    await write_groups(db, [StoredGroup.of(g, None) for g in groups])
    trainer = Trainer(
        nc, database_url, TrainerSettings(checkpoint_dir=str(tmp_path / "ckpt"), max_seq_len=128)
    )
    await trainer.start()
    task = asyncio.create_task(trainer.run())
    task.add_done_callback(lambda _: order.append("step ended"))
    try:
        request = TrainRequested(
            id=new_event_id(), project=PROJECT, model=MODEL, group_ids=[g.id for g in groups]
        )
        await publish_event(js, subjects.train("requested", PROJECT, MODEL), request)
        await asyncio.wait_for(resuming.wait(), 120)  # trained; the save waits for may_save
        task.cancel()
        may_save.set()  # the save takes a few ms; the cancellation alone would end the step sooner
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 60)
        assert order == ["saved", "step ended"]
    finally:
        may_save.set()
        trainer.stop()
        if not task.done():
            await asyncio.wait_for(task, 30)
        await trainer.close()
