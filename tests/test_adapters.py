"""Adapter archives (pack, verify, unpack safely), the Object Store, and the checkpoint watcher."""

from __future__ import annotations

import asyncio
import io
import json
import os
import random
import tarfile
from pathlib import Path

import nats
import pytest
import torch
from nats.js.api import ObjectStoreConfig
from nats.js.errors import NotFoundError, ObjectNotFoundError
from safetensors.torch import load_file, save_file

from artery.schemas import CheckpointDeleted, CheckpointPublished
from artery.schemas.base import new_event_id
from artery.services.inference.checkpoints import CheckpointWatcher
from artery.shared import bus, object_store, subjects
from artery.shared.adapters import (
    AdapterError,
    AdapterNotFound,
    get_adapter,
    pack_adapter,
    pack_files,
    put_adapter,
    read_archive_file,
    sha256_hex,
    unpack_adapter,
)
from artery.shared.object_store import write_object
from artery.shared.settings import CommonSettings
from tests.helpers import FakeEngine, wait_until

PROJECT, MODEL = "proj", "agent"


@pytest.fixture
def common_settings(nats_server) -> CommonSettings:
    return CommonSettings(nats_url=nats_server.url)  # NATS only: no PostgreSQL needed here


def make_adapter(directory: Path, seed: int = 0) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    generator = torch.Generator().manual_seed(seed)
    tensors = {
        "base_model.model.layers.0.q_proj.lora_A.weight": torch.randn(4, 16, generator=generator),
        "base_model.model.layers.0.q_proj.lora_B.weight": torch.zeros(16, 4),
    }
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    return directory


def tar_of(*members: tuple[tarfile.TarInfo, bytes | None]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buffer.getvalue()


def regular(name: str, data: bytes = b"{}") -> tuple[tarfile.TarInfo, bytes]:
    return tarfile.TarInfo(name), data


# -- packing and unpacking ---------------------------------------------------------------------------


def test_pack_unpack_round_trip_is_deterministic(tmp_path):
    source = make_adapter(tmp_path / "adapter")
    (source / "tokenizer.json").write_text("{}")
    (source / "README.md").write_text("# adapter")
    data = pack_adapter(source)
    os.utime(source / "adapter_config.json", (1, 1))  # times are not part of the archive
    assert pack_adapter(source) == data
    dest = unpack_adapter(data, tmp_path / "out" / "step-1", sha256_hex(data))
    assert sorted(p.name for p in dest.iterdir()) == sorted(p.name for p in source.iterdir())
    for name in ("adapter_config.json", "tokenizer.json", "README.md"):
        assert (dest / name).read_bytes() == (source / name).read_bytes()
    loaded = load_file(str(dest / "adapter_model.safetensors"))
    original = load_file(str(source / "adapter_model.safetensors"))
    assert loaded.keys() == original.keys()
    assert all(torch.equal(loaded[k], original[k]) for k in original)


def tarfile_pack(files: list[tuple[str, bytes]]) -> bytes:
    """What ``pack_files`` replaced: the members added through ``tarfile`` itself."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in files:
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


@pytest.mark.parametrize(
    "sizes",
    [(), (0,), (1,), (512,), (513, 0, 1024), (10240 - 1536,), (10240 - 1535,), (3 * 1024 * 1024 + 7, 99)],
)
def test_pack_files_writes_the_bytes_tarfile_writes(sizes):
    """Same bytes as before, so a step packed again has the sha256 it was stored and announced
    under: every padding case (empty, partial and whole blocks, the end record just full or one
    block over) and names that need a PAX header (long, non-ASCII)."""
    rng = random.Random(len(sizes))
    names = ["adapter_config.json", "a" * 150 + ".safetensors", "tokenizer-é.json"]
    files = [(names[i % len(names)] + str(i), rng.randbytes(size)) for i, size in enumerate(sizes)]
    packed = pack_files(files)
    assert packed == tarfile_pack(files)
    with tarfile.open(fileobj=io.BytesIO(packed), mode="r:") as tar:
        assert [(m.name, tar.extractfile(m).read()) for m in tar.getmembers()] == files


def test_sha_mismatch_writes_nothing(tmp_path):
    data = pack_adapter(make_adapter(tmp_path / "adapter"))
    with pytest.raises(AdapterError, match="sha256 mismatch"):
        unpack_adapter(data, tmp_path / "out" / "step-1", "0" * 64)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["adapter_model.bin", "optimizer.pt", "state.pkl", "w.pth"])
def test_pack_refuses_pickle_weights(tmp_path, name):
    source = make_adapter(tmp_path / "adapter")
    (source / name).write_bytes(b"\x80\x04")
    with pytest.raises(AdapterError, match="pickle"):
        pack_adapter(source)


def test_pack_refuses_links_folders_and_unknown_files(tmp_path):
    source = make_adapter(tmp_path / "adapter")
    (source / "link.json").symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(AdapterError, match="regular files"):
        pack_adapter(source)
    (source / "link.json").unlink()
    (source / "nested").mkdir()
    with pytest.raises(AdapterError, match="regular files"):
        pack_adapter(source)
    (source / "nested").rmdir()
    (source / "run.sh").write_text("echo hi")
    with pytest.raises(AdapterError, match="not an adapter file"):
        pack_adapter(source)


def _link(name: str, target: str, kind: bytes) -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info, None


@pytest.mark.parametrize(
    "member, message",
    [
        (regular("../evil.json"), "plain file names"),
        (regular("/etc/evil.json"), "plain file names"),
        (regular("sub/adapter_model.safetensors"), "plain file names"),
        (regular("adapter_model.bin", b"\x80\x04"), "pickle"),
        (_link("tokenizer.json", "/etc/passwd", tarfile.SYMTYPE), "regular files"),
        (_link("vocab.json", "adapter_config.json", tarfile.LNKTYPE), "regular files"),
    ],
)
def test_unpack_refuses_unsafe_members_and_writes_nothing(tmp_path, member, message):
    data = tar_of(regular("adapter_config.json"), member)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(AdapterError, match=message):
        unpack_adapter(data, out / "step-1", sha256_hex(data))
    assert list(out.iterdir()) == [] and not (tmp_path / "evil.json").exists()


def test_unpack_replaces_an_existing_copy_whole(tmp_path):
    dest = tmp_path / "out" / "step-1"
    dest.mkdir(parents=True)
    (dest / "stale.safetensors").write_bytes(b"old")
    data = pack_adapter(make_adapter(tmp_path / "adapter"))
    unpack_adapter(data, dest, sha256_hex(data))
    assert sorted(p.name for p in dest.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert [p.name for p in dest.parent.iterdir()] == ["step-1"]  # no staging folder left behind


# -- object store ----------------------------------------------------------------------------------


async def test_object_store_round_trip(js, tmp_path):
    data = pack_adapter(make_adapter(tmp_path / "adapter"))
    await put_adapter(js, "proj/agent/step-1", data)
    assert await get_adapter(js, "proj/agent/step-1") == data
    with pytest.raises(AdapterNotFound):
        await get_adapter(js, "proj/agent/step-404")


async def test_both_digest_spellings_are_the_one_nats_py_stores(js):
    """From the bytes (``nats_digest``) or from an event's hex sha256 (``nats_digest_of_hex``, the
    publisher's): both equal what nats-py's own ``put`` records, so a repeat upload is seen."""
    data = os.urandom(200_000)
    store = await js.object_store(subjects.ADAPTERS_BUCKET)
    stored = await store.put("proj/agent/digest", data)
    assert object_store.nats_digest(data) == stored.digest
    assert object_store.nats_digest_of_hex(sha256_hex(data)) == stored.digest


@pytest.mark.parametrize("window", [2, object_store.WRITE_WINDOW])
async def test_a_pipelined_write_is_the_object_nats_py_itself_reads(js, monkeypatch, window):
    """``write_object`` lays an object out as nats-py's ``put`` does: nats-py's own reader gets
    the same bytes and info, over many chunks (in windows that end inside the object or past
    it); a second write replaces the first and purges its chunks; an empty object is one too."""
    monkeypatch.setattr(object_store, "WRITE_WINDOW", window)
    store = await js.object_store(subjects.ADAPTERS_BUCKET)
    first = os.urandom(5 * 128 * 1024 + 17)  # six chunks, the last one short
    info = await write_object(js, subjects.ADAPTERS_BUCKET, "proj/agent/big", first)
    assert (info.size, info.chunks) == (len(first), 6)
    read = await store.get("proj/agent/big")
    assert read.data == first
    assert read.info.digest == info.digest and read.info.nuid == info.nuid
    assert await get_adapter(js, "proj/agent/big") == first

    second = os.urandom(3 * 128 * 1024)
    replaced = await write_object(js, subjects.ADAPTERS_BUCKET, "proj/agent/big", second)
    assert (await store.get("proj/agent/big")).data == second
    stream = f"OBJ_{subjects.ADAPTERS_BUCKET}"
    with pytest.raises(NotFoundError):  # the first version's chunks are gone
        await js.get_msg(stream, seq=1, subject=f"$O.{subjects.ADAPTERS_BUCKET}.C.{info.nuid}", next=True)
    assert replaced.nuid != info.nuid

    await write_object(js, subjects.ADAPTERS_BUCKET, "proj/agent/empty", b"")
    assert (await store.get("proj/agent/empty")).data == b""


@pytest.mark.parametrize("batch", [1, 4, object_store.READ_BATCH])
async def test_an_object_is_read_whole_in_batches_of_any_size(js, monkeypatch, batch):
    """Batched direct gets over several requests (a batch ending inside the object, on its
    last chunk, past it) read the same bytes; so does the one-get-a-chunk path of older servers,
    from another object's chunks interleaved in the same stream."""
    monkeypatch.setattr(object_store, "READ_BATCH", batch)
    bucket = subjects.ADAPTERS_BUCKET
    one, two = os.urandom(4 * 128 * 1024), os.urandom(9 * 128 * 1024 + 1)
    infos = await asyncio.gather(write_object(js, bucket, "a", one), write_object(js, bucket, "b", two))
    assert await object_store.read_object(js, bucket, infos[0]) == one
    assert await object_store.read_object(js, bucket, infos[1]) == two
    monkeypatch.setattr(object_store, "_has_batched_gets", lambda js: False)
    assert await object_store.read_object(js, bucket, infos[1]) == two


async def test_a_stream_without_direct_gets_is_read_chunk_by_chunk(js):
    """A bucket made without direct gets answers a batched get with 503: the reader goes on
    with message gets and reads the whole object."""
    bucket = "artery_no_direct"
    await js.create_object_store(bucket)
    config = (await js.stream_info(f"OBJ_{bucket}")).config
    config.allow_direct = False
    await js.update_stream(config)
    data = os.urandom(3 * 128 * 1024 + 5)
    info = await write_object(js, bucket, "x", data)
    assert object_store._has_batched_gets(js)
    assert await object_store.read_object(js, bucket, info) == data


async def test_a_batched_get_left_unanswered_falls_back_for_the_connection(nats_server, nc, monkeypatch):
    """Credentials from before reads were batched: the server drops the request and nothing
    answers. The read goes on chunk by chunk, and the connection stops asking in batches.
    (``nc`` made the buckets.)"""
    client = await nats.connect(nats_server.url)
    try:
        js = client.jetstream(timeout=0.3)
        data = os.urandom(3 * 128 * 1024)
        info = await write_object(js, subjects.ADAPTERS_BUCKET, "unanswered", data)
        publish, asked = client.publish, []

        async def dropping(subject, payload=b"", reply="", headers=None):
            if subject.startswith("$JS.API.DIRECT.GET."):
                asked.append(subject)
                return None  # as the server does with a publish the user may not make
            return await publish(subject, payload, reply=reply, headers=headers)

        monkeypatch.setattr(client, "publish", dropping)
        assert await object_store.read_object(js, subjects.ADAPTERS_BUCKET, info) == data
        assert await object_store.read_object(js, subjects.ADAPTERS_BUCKET, info) == data
        assert len(asked) == 1 and not object_store._has_batched_gets(js)
    finally:
        await client.close()


async def test_a_write_the_bucket_refuses_raises_and_leaves_no_chunks(js):
    """A chunk the stream refuses (over the bucket's size) fails the write: it raises, no
    metadata names the object, and the chunks that were stored are purged."""
    bucket = "artery_small_bucket"
    await js.create_object_store(bucket, config=ObjectStoreConfig(max_bytes=512 * 1024))
    with pytest.raises(Exception):  # noqa: B017 -- the server's refusal, whatever nats-py names it
        await write_object(js, bucket, "too/big", os.urandom(2 * 1024 * 1024))
    store = await js.object_store(bucket)
    with pytest.raises((ObjectNotFoundError, NotFoundError)):
        await store.get_info("too/big")
    assert (await store.status()).stream_info.state.messages == 0


# -- checkpoint watcher --------------------------------------------------------------------------


async def publish_adapter(js, tmp_path: Path, step: int, *, sha256: str | None = None) -> bytes:
    data = pack_adapter(make_adapter(tmp_path / f"adapter-{step}", seed=step))
    object_name = f"{PROJECT}/{MODEL}/step-{step}"
    await put_adapter(js, object_name, data)
    event = CheckpointPublished(
        id=new_event_id(),
        project=PROJECT,
        model=MODEL,
        step=step,
        object_name=object_name,
        sha256=sha256 or sha256_hex(data),
        size_bytes=len(data),
        base_model="tiny",
        served_name=f"{MODEL}@{step}",
    )
    await bus.publish_event(js, subjects.checkpoint("published", PROJECT, MODEL), event)
    return data


async def test_watcher_loads_the_newest_published_adapter_then_follows_live(js, tmp_path):
    await publish_adapter(js, tmp_path, 1)
    await publish_adapter(js, tmp_path, 2)  # published before the replica started
    engine = FakeEngine()
    loaded: list[tuple[int, str]] = []
    watcher = CheckpointWatcher(
        js,
        PROJECT,
        MODEL,
        engine,
        lambda step, name: loaded.append((step, name)),
        cache_dir=tmp_path / "cache",
    )
    await watcher.start()
    try:
        await wait_until(lambda: loaded == [(2, f"{MODEL}@2")])  # the newest, not every step ever

        async def on_loaded_async(step: int, name: str) -> None:
            loaded.append((step, name))

        watcher.on_loaded = on_loaded_async  # an async callback works too
        await publish_adapter(js, tmp_path, 3, sha256="f" * 64)  # corrupt: announced hash is wrong
        await publish_adapter(js, tmp_path, 4)
        await wait_until(lambda: len(loaded) == 2)
        assert loaded == [(2, f"{MODEL}@2"), (4, f"{MODEL}@4")]
        assert engine.adapters() == [f"{MODEL}@2", f"{MODEL}@4"]  # step 3 skipped, never loaded
        expected = load_file(str(tmp_path / "adapter-4" / "adapter_model.safetensors"))
        assert all(torch.equal(engine.loads[1][1][k], v) for k, v in expected.items())
        assert not (tmp_path / "cache" / PROJECT / MODEL / "step-3").exists()
    finally:
        await watcher.stop()


async def test_watcher_unloads_a_step_that_retention_deleted(js, tmp_path):
    engine = FakeEngine()
    watcher = CheckpointWatcher(
        js, PROJECT, MODEL, engine, lambda step, name: None, cache_dir=tmp_path / "cache"
    )
    await watcher.start()
    try:
        await publish_adapter(js, tmp_path, 1)
        await publish_adapter(js, tmp_path, 2)
        await wait_until(lambda: len(engine.loads) == 2)
        deleted = CheckpointDeleted(
            id=new_event_id(), project=PROJECT, model=MODEL, step=1, object_name=f"{PROJECT}/{MODEL}/step-1"
        )
        await bus.publish_event(js, subjects.checkpoint("deleted", PROJECT, MODEL), deleted)
        await wait_until(lambda: engine.unloads == [f"{MODEL}@1"])
        assert engine.adapters() == [f"{MODEL}@2"]
        await wait_until(lambda: not (tmp_path / "cache" / PROJECT / MODEL / "step-1").exists())
        assert (tmp_path / "cache" / PROJECT / MODEL / "step-2").exists()
    finally:
        await watcher.stop()


def test_a_named_archive_file_is_read_only_if_it_is_a_regular_file_within_the_limit(tmp_path):
    """What a ``checkpoint.saved`` event names is read by replicas: a device would exhaust memory,
    a FIFO would block the loader for good, so neither is read at all."""
    archive = tmp_path / "step-1.tar"
    archive.write_bytes(b"x" * 100)
    assert read_archive_file(archive) == b"x" * 100
    with pytest.raises(AdapterError, match="over 99"):
        read_archive_file(archive, max_bytes=99)
    with pytest.raises(AdapterError, match="not a regular file"):
        read_archive_file(Path("/dev/zero"))
    with pytest.raises(AdapterError, match="not a regular file"):
        read_archive_file(tmp_path)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(AdapterError, match="not a regular file"):
        read_archive_file(fifo)  # returns at once: opened non-blocking, refused by its type
    with pytest.raises(FileNotFoundError):
        read_archive_file(tmp_path / "missing.tar")
