"""No disk shared between services (#30): a trained step reaches the publisher, replicas and other
trainer workers through the trainer-state object store alone.

Real nats-server, PostgreSQL and publisher; the trainer's side with the real tiny model, each
"host" with a checkpoint directory of its own.
"""

from __future__ import annotations

import asyncio
import io
import json
import shutil
import tarfile
import threading

import msgspec
import pytest
import torch
from nats.js.errors import NotFoundError

from artery.schemas import (
    CheckpointPublished,
    CheckpointSaved,
    CheckpointStaged,
    DeadLetter,
    ModelRecord,
    TrainCompleted,
    TrainConfig,
    TrainRequested,
    new_event_id,
)
from artery.services.publisher.service import object_name
from artery.services.trainer import announce, checkpoints, step_files
from artery.services.trainer.checkpoints import (
    ADAPTER_TAR,
    PolicyCache,
    save_step,
    step_dir,
    step_for_request,
)
from artery.services.trainer.policy import Policy
from artery.services.trainer.settings import TrainerSettings
from artery.shared import object_store, subjects, trainer_state
from artery.shared.adapters import get_adapter, pack_adapter, pack_files, sha256_hex
from artery.shared.bus import publish_event
from artery.shared.errors import DependencyUnavailable
from artery.shared.models import TINY
from tests.helpers import wait_for
from tests.test_publisher import messages_on, settled
from tests.test_replica_follows import following, publishing
from tests.test_replica_loads_saved import RecordingEngine, watcher_for
from tests.test_security import PROJECT as SECURED_PROJECT
from tests.test_security import secured  # noqa: F401  (a fixture)
from tests.test_trainer_policy import scored_groups

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("single_torch_thread")]
PROJECT, MODEL = "demo", "agent"
MAX_SEQ_LEN = 256


def record(step: int = 0) -> ModelRecord:
    return ModelRecord(project=PROJECT, name=MODEL, base_model=TINY, trainable=True, step=step)


def request() -> TrainRequested:
    return TrainRequested(id=new_event_id(), project=PROJECT, model=MODEL, group_ids=["g1"])


def host(tmp_path, name: str) -> TrainerSettings:
    """A trainer worker's settings on a host of its own: its own checkpoint directory."""
    return TrainerSettings(checkpoint_dir=str(tmp_path / name / "checkpoints"), max_seq_len=MAX_SEQ_LEN)


async def train_and_announce(
    js, settings: TrainerSettings, cache: PolicyCache
) -> tuple[Policy, int, TrainRequested]:
    """One GRPO step of the model as the trainer service takes it: resume, train, save, announce."""
    policy, step = await cache.get(record())
    asked = request()
    result = await asyncio.to_thread(
        policy.train_step, scored_groups(policy), TrainConfig(learning_rate=1e-2), max_seq_len=MAX_SEQ_LEN
    )
    assert result.trained
    await asyncio.to_thread(save_step, settings, record(), policy, step + 1, asked.id, result.metrics)
    cache.advance(record(), step + 1)
    await publish_from_disk(js, settings, asked, record(), step + 1, result.metrics)
    return policy, step + 1, asked


async def publish_from_disk(
    js, settings: TrainerSettings, asked: TrainRequested, rec: ModelRecord, step: int, metrics: dict
) -> None:
    """``announce.publish_checkpoint`` of a step directory, as the trainer publishes a step it
    finds saved (a request redelivered after a crash)."""
    files = await asyncio.to_thread(step_files.StepFiles.read, step_dir(settings, rec, step))
    await announce.publish_checkpoint(js, asked, rec, step, metrics, files)


def adapter_weights(policy: Policy) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in policy.named_trainable}


def optimizer_tensors(policy: Policy) -> dict[str, torch.Tensor]:
    state = policy.optimizer.state_dict()["state"]
    return {
        f"{i}.{k}": v
        for i, entries in state.items()
        for k, v in entries.items()
        if isinstance(v, torch.Tensor)
    }


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and a
    for key in a:
        assert torch.equal(a[key], b[key]), key


async def test_the_publisher_publishes_the_adapter_the_trainer_saved_with_no_disk_shared(
    nc, js, database_url, tmp_path
):
    trainer = host(tmp_path, "trainer")
    published = await nc.subscribe(subjects.checkpoint("published", PROJECT, MODEL))
    await nc.flush()
    _, step, _ = await train_and_announce(js, trainer, PolicyCache(trainer, js))
    saved_archive = (step_dir(trainer, record(), step) / ADAPTER_TAR).read_bytes()
    shutil.rmtree(trainer.checkpoint_dir)  # nothing of the trainer's disk is left to read

    async with publishing(nc, database_url, keep_latest=10):
        event = msgspec.json.decode((await published.next_msg(timeout=60)).data, type=CheckpointPublished)
    assert (event.step, event.sha256, event.size_bytes) == (1, sha256_hex(saved_archive), len(saved_archive))
    assert await get_adapter(js, object_name(PROJECT, MODEL, 1)) == saved_archive
    saved = await js.get_last_msg(subjects.CHECKPOINTS.name, subjects.checkpoint("saved", PROJECT, MODEL))
    assert json.loads(saved.data)["uri"] == trainer_state.uri(
        trainer_state.object_name(PROJECT, MODEL, 1, trainer_state.ADAPTER)
    )


async def test_the_adapter_is_staged_before_the_state_is_stored_and_both_before_saved(nc, js, tmp_path):
    """The trainer's order for a step: the adapter stored and ``checkpoint.staged`` sent (a replica
    fetches it ahead), then the optimizer state stored, then ``checkpoint.saved``. The store is
    read as each announcement is heard."""
    trainer = host(tmp_path, "trainer")
    adapter = trainer_state.object_name(PROJECT, MODEL, 1, trainer_state.ADAPTER)
    state = trainer_state.object_name(PROJECT, MODEL, 1, trainer_state.STATE)
    heard: list[str] = []  # in the order the announcements arrived
    events: dict[str, dict] = {}
    stored: dict[str, bool] = {}
    both = asyncio.Event()

    def listener(kind: str):
        async def on(msg) -> None:
            heard.append(kind)
            events[kind] = json.loads(msg.data)
            stored[f"adapter at {kind}"] = (
                await object_store.object_info(js, trainer_state.BUCKET, adapter) is not None
            )
            stored[f"state at {kind}"] = (
                await object_store.object_info(js, trainer_state.BUCKET, state) is not None
            )
            if kind == "saved":
                both.set()

        return on

    subs = [
        await nc.subscribe(subjects.checkpoint_staged(PROJECT, MODEL), cb=listener("staged")),
        await nc.subscribe(subjects.checkpoint("saved", PROJECT, MODEL), cb=listener("saved")),
    ]
    await nc.flush()  # both subscriptions are on the server before the step
    await train_and_announce(js, trainer, PolicyCache(trainer, js))
    await asyncio.wait_for(both.wait(), 30)
    assert heard == ["staged", "saved"]
    # The hint came with the adapter there to fetch; the step was announced with its state stored.
    assert stored["adapter at staged"] and stored["adapter at saved"] and stored["state at saved"]
    fields = ("step", "uri", "sha256", "size_bytes")
    assert {k: events["staged"][k] for k in fields} == {k: events["saved"][k] for k in fields}
    for sub in subs:
        await sub.unsubscribe()


async def test_a_worker_with_an_empty_disk_resumes_the_model_from_the_store(js, tmp_path):
    first_host, second_host = host(tmp_path, "first"), host(tmp_path, "second")
    first = PolicyCache(first_host, js)
    trained, step, asked = await train_and_announce(js, first_host, first)
    assert step == 1

    second = PolicyCache(second_host, js)  # another worker: nothing on its disk
    resumed, resumed_step = await second.get(record())
    assert resumed_step == 1 and resumed.step == 1
    assert_same_tensors(adapter_weights(trained), adapter_weights(resumed))
    assert_same_tensors(optimizer_tensors(trained), optimizer_tensors(resumed))
    # The step's record came with it: a redelivered request is answered, not trained again.
    found = step_for_request(second_host, record(), asked.id)
    assert found is not None and found[0] == 1
    assert (step_dir(second_host, record(), 1) / ADAPTER_TAR).read_bytes() == (
        step_dir(first_host, record(), 1) / ADAPTER_TAR
    ).read_bytes()

    # The second worker trains the next step; the first takes that one from the store in turn.
    after, next_step, _ = await train_and_announce(js, second_host, second)
    assert next_step == 2
    again, again_step = await first.get(record(step=2))
    assert again_step == 2 and again.step == 2
    assert_same_tensors(adapter_weights(after), adapter_weights(again))
    assert_same_tensors(optimizer_tensors(after), optimizer_tensors(again))


def fake_step(settings: TrainerSettings, step: int, fill: int | None = None) -> None:
    """A step directory as save_step leaves it, without a model (for what only moves files)."""
    final = step_dir(settings, record(), step)
    weights = bytes([step % 256 if fill is None else fill])
    (final / "adapter").mkdir(parents=True)
    (final / "adapter" / "adapter_config.json").write_text('{"r": 8, "peft_type": "LORA"}')
    (final / "adapter" / "adapter_model.safetensors").write_bytes(weights * 5_000)
    (final / "optimizer.safetensors").write_bytes(weights * 9_000)
    (final / "trainer_state.json").write_text(json.dumps({"step": step}))
    (final / "step.json").write_text(json.dumps({"step": step, "request_id": f"r{step}", "metrics": {}}))
    (final / ADAPTER_TAR).write_bytes(pack_adapter(final / "adapter"))


async def stored_steps(js, kind: str, upto: int) -> list[int]:
    return [
        s
        for s in range(1, upto + 1)
        if await trainer_state.info(js, trainer_state.object_name(PROJECT, MODEL, s, kind))
    ]


def test_a_step_in_memory_is_the_step_on_disk_and_the_one_restored(tmp_path):
    """What the trainer uploads (``StepFiles``) is what it writes, and the state archive with the
    adapter stored beside it unpacks to the same directory (the adapter is stored once)."""
    policy = Policy.create(TINY)
    files = step_files.snapshot_step(policy, 1, "r1", {"loss": 0.5})
    written = files.write(tmp_path / "written")
    assert step_files.StepFiles.read(written) == files
    assert (written / ADAPTER_TAR).read_bytes() == pack_adapter(written / "adapter") == files.adapter_tar
    state = files.state_tar(sha256_hex(files.adapter_tar))
    assert not any(name.startswith("adapter/") for name, _ in step_files._read_members(state, "state"))
    stored = step_files.read_state(state)
    assert stored.adapter == (sha256_hex(files.adapter_tar), len(files.adapter_tar))
    restored = step_files.unpack_state(stored, tmp_path / "restored", files.adapter_tar)
    assert step_files.StepFiles.read(restored) == files
    assert (restored / ADAPTER_TAR).read_bytes() == files.adapter_tar  # as stored, not packed again
    assert Policy.restore(restored, TINY).step == policy.step


def test_a_state_archive_restores_only_with_the_adapter_it_names(tmp_path):
    files = step_files.snapshot_step(Policy.create(TINY), 1, "r1", {})
    state = files.state_tar(sha256_hex(files.adapter_tar))
    with pytest.raises(checkpoints.ModelUnusable, match="none was given"):
        step_files.unpack_state(step_files.read_state(state), tmp_path / "000001")
    # An archive that holds adapter/ and names an adapter too is neither kind: refused.
    both = pack_files([*step_files._read_members(state, "state"), ("adapter/adapter_config.json", b"{}")])
    with pytest.raises(checkpoints.ModelUnusable, match="names another adapter"):
        step_files.read_state(both)
    garbled = pack_files(
        [
            (n, b'{"sha256": 1}' if n == step_files.ADAPTER_DIGEST else d)
            for n, d in step_files._read_members(state, "state")
        ]
    )
    with pytest.raises(checkpoints.ModelUnusable, match="not valid"):
        step_files.read_state(garbled)
    members = step_files._read_members(state, "state")
    with pytest.raises(checkpoints.ModelUnusable, match="appears twice"):
        step_files.read_state(pack_files([*members, members[0]]))
    twice = pack_files([*step_files._read_members(files.adapter_tar, "adapter")] * 2)
    with pytest.raises(checkpoints.ModelUnusable, match="appears twice"):
        step_files.unpack_state(step_files.read_state(state), tmp_path / "000001", twice)
    assert not (tmp_path / "000001").exists()


async def test_a_state_stored_beside_another_adapter_than_it_names_is_not_resumed(js, tmp_path):
    """The step's adapter object was replaced after its state was stored (a step trained again
    and stored halfway): resuming refuses the pair and asks again later, the disk untouched."""
    first_host = host(tmp_path, "first")
    await train_and_announce(js, first_host, PolicyCache(first_host, js))
    name = trainer_state.object_name(PROJECT, MODEL, 1, trainer_state.ADAPTER)
    files = step_files.snapshot_step(Policy.create(TINY, seed=5), 1, "other", {})
    await trainer_state.put(js, name, files.adapter_tar)
    second_host = host(tmp_path, "second")
    with pytest.raises(DependencyUnavailable, match="sha256"):
        await PolicyCache(second_host, js).get(record())
    assert not step_dir(second_host, record(), 1).exists()


async def test_a_state_stored_before_the_adapter_was_stored_once_still_restores(js, tmp_path):
    """A state archive of before holds ``adapter/`` itself, and names no adapter."""
    files = step_files.snapshot_step(Policy.create(TINY), 1, "r1", {})
    old = pack_files([*files.state, *((f"adapter/{n}", d) for n, d in files.adapter)])
    await trainer_state.put(js, trainer_state.object_name(PROJECT, MODEL, 1, trainer_state.STATE), old)
    settings = host(tmp_path, "worker")
    assert await PolicyCache(settings, js)._from_store(record(), 0, cached=False) == 1
    assert step_files.StepFiles.read(step_dir(settings, record(), 1)) == files


async def test_the_store_keeps_only_the_newest_steps_of_a_model(js, tmp_path):
    settings = host(tmp_path, "trainer")
    neighbour = trainer_state.object_name(PROJECT, f"{MODEL}.v2", 1, trainer_state.STATE)
    await trainer_state.put(js, neighbour, b"another model's step 1")
    last = announce.KEEP_ADAPTER_STEPS + 2
    for step in range(1, last + 1):
        fake_step(settings, step)
        await publish_from_disk(js, settings, request(), record(), step, {})
        await announce.prune_stored_steps(js, PROJECT, MODEL, step)
        if step == 2:  # a redelivered request uploads the same bytes again: nothing is replaced
            name = trainer_state.object_name(PROJECT, MODEL, 2, trainer_state.STATE)
            before = await trainer_state.info(js, name)
            await publish_from_disk(js, settings, request(), record(), step, {})
            after = await trainer_state.info(js, name)
            assert before is not None and after is not None and before.nuid == after.nuid
    states = list(range(last - announce.KEEP_STATE_STEPS + 1, last + 1))
    adapters = list(range(last - announce.KEEP_ADAPTER_STEPS + 1, last + 1))
    assert await stored_steps(js, trainer_state.STATE, last) == states
    assert await stored_steps(js, trainer_state.ADAPTER, last) == adapters
    assert await trainer_state.info(js, neighbour) is not None  # pruning is per model


async def test_other_bytes_for_a_stored_step_replace_it_and_leave_no_old_chunk(js):
    """``put`` hands the metadata it read to the write, which purges the old version's chunks
    with it: the stream then holds the new chunks and nothing of the old ones."""
    name = trainer_state.object_name(PROJECT, MODEL, 1, trainer_state.STATE)
    await trainer_state.put(js, name, b"a" * 300_000)  # three chunks
    first = await trainer_state.info(js, name)
    await trainer_state.put(js, name, b"b" * 200_000)
    second = await trainer_state.info(js, name)
    assert first is not None and second is not None and first.nuid != second.nuid
    assert await trainer_state.get(js, name) == b"b" * 200_000
    stream = f"OBJ_{trainer_state.BUCKET}"
    with pytest.raises(NotFoundError):
        await js.get_msg(stream, seq=1, subject=f"$O.{trainer_state.BUCKET}.C.{first.nuid}", next=True)


async def test_a_step_this_worker_never_uploaded_gives_way_to_the_one_stored(js, tmp_path):
    """A worker that saved step 1 and died before uploading it comes back to find step 1 trained
    again by another worker: the stored step replaces its own, which nobody else ever saw."""
    here, there = host(tmp_path, "here"), host(tmp_path, "there")
    fake_step(here, 1, fill=7)
    fake_step(there, 1, fill=9)
    await publish_from_disk(js, there, request(), record(), 1, {})
    assert await PolicyCache(here, js)._from_store(record(), 1, cached=False) == 1
    mine, stored = (step_dir(s, record(), 1) for s in (here, there))
    assert (mine / ADAPTER_TAR).read_bytes() == (stored / ADAPTER_TAR).read_bytes()
    assert (mine / "optimizer.safetensors").read_bytes() == (stored / "optimizer.safetensors").read_bytes()
    # The same step on both sides is left alone (not downloaded and replaced).
    inode = stored.stat().st_ino
    assert await PolicyCache(there, js)._from_store(record(), 1, cached=False) == 1
    assert stored.stat().st_ino == inode


async def test_a_saved_uri_naming_another_tenants_object_or_bucket_is_refused(
    nc, js, db, database_url, tmp_path
):
    """A checkpoint.saved may only name its own model's step in the trainer-state store: another
    project's object, another bucket or another step is dead-lettered with the reason and never
    published, and a replica that loads saved adapters does not load it either."""
    settings = host(tmp_path, "trainer")
    fake_step(settings, 1)
    data = (step_dir(settings, record(), 1) / ADAPTER_TAR).read_bytes()
    theirs = trainer_state.object_name("other-project", MODEL, 1, trainer_state.ADAPTER)
    await trainer_state.put(js, theirs, data)  # another tenant's step, really there
    own = trainer_state.object_name(PROJECT, MODEL, 1, trainer_state.ADAPTER)
    refused = {
        "another project or model": saved_event(data, trainer_state.uri(theirs)),
        "only artery_trainer_state is read": saved_event(
            data, f"nats-object://{subjects.ADAPTERS_BUCKET}/{own}"
        ),
        "is not step 2's adapter": saved_event(data, trainer_state.uri(own), step=2),
    }
    dlq = await js.subscribe(subjects.dead_letter("publisher"))
    async with publishing(nc, database_url, keep_latest=10):
        for event in refused.values():
            await publish_event(js, subjects.checkpoint("saved", PROJECT, MODEL), event)
        letters = [
            msgspec.json.decode((await dlq.next_msg(timeout=30)).data, type=DeadLetter) for _ in refused
        ]
        await wait_for(lambda: settled(js), timeout=30)
    by_id = {letter.original_id: letter for letter in letters}
    for reason, event in refused.items():
        assert by_id[event.id].kind == "uri" and reason in by_id[event.id].reason, by_id[event.id]
    assert await messages_on(js, subjects.checkpoint("published", PROJECT, MODEL)) == 0
    assert await db.fetchval("SELECT count(*) FROM checkpoints") == 0

    engine = RecordingEngine()
    replica = watcher_for(js, engine, tmp_path, "replica", load_saved=True)
    assert await replica._load_saved(1, f"{MODEL}@1", refused["another project or model"]) is None
    assert engine.started == []


async def test_a_replica_loads_a_saved_step_from_the_store_before_it_is_published(js, tmp_path):
    settings = host(tmp_path, "trainer")
    fake_step(settings, 1)
    engine = RecordingEngine()
    replica = watcher_for(js, engine, tmp_path / "replica-host", "replica", load_saved=True)
    async with following(replica):
        await publish_from_disk(js, settings, request(), record(), 1, {})
        await engine.next_load()  # no publisher runs: the adapter came from the trainer's store
    data = (step_dir(settings, record(), 1) / ADAPTER_TAR).read_bytes()
    assert engine.started == [f"{MODEL}@1"] and replica.loaded == {f"{MODEL}@1": sha256_hex(data)}


def saved_event(data: bytes, uri: str, step: int = 1) -> CheckpointSaved:
    return CheckpointSaved(
        id=new_event_id(),
        project=PROJECT,
        model=MODEL,
        step=step,
        uri=uri,
        sha256=sha256_hex(data),
        size_bytes=len(data),
        base_model=TINY,
    )


def test_a_state_archive_cannot_write_outside_its_step(tmp_path):
    def archive(*names: str) -> bytes:
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as tar:
            for name in names:
                info = tarfile.TarInfo(name)
                info.size = 2
                tar.addfile(info, io.BytesIO(b"{}"))
        return buffer.getvalue()

    needed = ("step.json", "trainer_state.json", "adapter/adapter_config.json")
    for bad in (
        "../escape.json",
        "/abs.json",
        "adapter/../../x.json",
        "sub/dir/x.json",
        "weights.pt",
        "adapter/w.bin",
    ):
        with pytest.raises(checkpoints.ModelUnusable):
            step_files.unpack_state(step_files.read_state(archive(*needed, bad)), tmp_path / "000001")
    assert not (tmp_path / "000001").exists() and not (tmp_path.parent / "escape.json").exists()
    restored = step_files.unpack_state(step_files.read_state(archive(*needed)), tmp_path / "000001")
    assert (restored / ADAPTER_TAR).is_file() and (restored / "step.json").read_text() == "{}"


async def test_each_role_reaches_the_store_as_its_permissions_say(secured, tmp_path):  # noqa: F811
    """Under the stack's NATS users: the trainer writes the store and resumes from it, the
    publisher and a replica read an adapter from it message by message; no one else writes it,
    and an agent cannot read it."""
    settings = host(tmp_path, "trainer")
    fake_step(settings, 1)
    data = (step_dir(settings, record(), 1) / ADAPTER_TAR).read_bytes()
    name = trainer_state.object_name(PROJECT, MODEL, 1, trainer_state.ADAPTER)
    trainer = await secured.connect("trainer")
    replica = await secured.connect("inference")
    staged = await replica.nc.subscribe(subjects.checkpoint_staged(PROJECT, MODEL))
    await replica.nc.flush()
    await publish_from_disk(trainer.js, settings, request(), record(), 1, {})
    hint = msgspec.json.decode((await staged.next_msg(timeout=10)).data, type=CheckpointStaged)
    assert (hint.step, hint.sha256) == (1, sha256_hex(data))  # the trainer's hint reaches replicas
    assert await PolicyCache(host(tmp_path, "second"), trainer.js)._from_store(record(), 0, cached=False) == 1
    trainer.clean()
    for role in ("publisher", "inference"):
        reader = await secured.connect(role)
        assert await trainer_state.get(reader.js, name, sha256=sha256_hex(data), size=len(data)) == data
        reader.clean()
        await reader.denied(f"$O.{trainer_state.BUCKET}.", trainer_state.put(reader.js, name, b"evil"))
    agent = await secured.connect(f"agent-{SECURED_PROJECT}")
    stream = f"OBJ_{trainer_state.BUCKET}"
    await agent.denied(f"$JS.API.STREAM.MSG.GET.{stream}", trainer_state.get(agent.js, name))
    # Nor send replicas a hint, or hear the trainer's.
    hint_subject = subjects.checkpoint_staged(SECURED_PROJECT, MODEL)
    await agent.denied(hint_subject, agent.nc.publish(hint_subject, b"{}"))
    await agent.denied(hint_subject, agent.nc.subscribe(hint_subject), what="Subscription")
    assert await trainer_state.get(trainer.js, name) == data


async def test_a_step_that_could_not_be_taken_in_memory_is_trained_again_from_the_saved_step(
    nc, js, db, database_url, tmp_path, monkeypatch
):
    """Taking the trained step in memory fails once (out of memory): the request is retried, and
    the retry starts from the step saved before, loaded again, never from the policy in memory,
    which holds the step that was not saved (training on it would take that step twice)."""
    from artery.services.collector.store import StoredGroup, write_groups
    from tests.factories import register_trainable
    from tests.test_db_faults import MODEL as DB_MODEL
    from tests.test_db_faults import PROJECT as DB_PROJECT
    from tests.test_db_faults import text_group
    from tests.test_trainer_budgets import Answers, running_trainer, settings_for
    from tests.test_trainer_budgets import request as train_request

    await register_trainable(js, DB_PROJECT, DB_MODEL, TINY)
    groups = [text_group(seed) for seed in range(2)]
    await write_groups(db, [StoredGroup.of(g, None) for g in groups])
    failed: list[int] = []
    snapshot = step_files.snapshot_step
    threads: set[str] = set()  # where the policies' tensors were touched

    def fails_once(policy, step, *args):
        threads.add(threading.current_thread().name)
        if not failed:
            failed.append(step)
            raise MemoryError("the step's files did not fit")
        return snapshot(policy, step, *args)

    monkeypatch.setattr(step_files, "snapshot_step", fails_once)
    loads: list[int] = []
    load = PolicyCache._load

    def counted(self, rec, step):
        threads.add(threading.current_thread().name)
        loads.append(step)
        return load(self, rec, step)

    monkeypatch.setattr(PolicyCache, "_load", counted)
    settings = settings_for(tmp_path)
    async with Answers(js, DB_PROJECT, DB_MODEL) as answers, running_trainer(nc, database_url, settings):
        asked = await train_request(js, DB_PROJECT, DB_MODEL, [g.id for g in groups])
        completed = await answers.of(asked.id)
    assert isinstance(completed, TrainCompleted) and completed.step == 1, completed
    assert failed == [1]
    assert loads == [0, 0], "the retry trained on the policy in memory, which held the unsaved step"
    # Loads and snapshots, of both tries, on the trainer's one torch thread (torch_thread.py).
    assert len(threads) == 1 and threads.pop().startswith("artery-trainer-torch"), threads
