"""A replica that died but is still registered (its heartbeat not yet expired) cannot ack a
pause: the trainer waits that out with back-off, never dead-letters the request, and trains once
the registry forgets the dead replica."""

from __future__ import annotations

import asyncio

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
