"""Who may do what: NATS users generated from ``subjects`` (``shared.permissions``), enforced by a
real nats-server; credentials and TLS on connect (``shared.auth``); PostgreSQL roles (0005).

Covered elsewhere: the inference API key (``test_inference_api.py::test_api_key``) and adapters
verified by sha256 before they are loaded (``test_adapters.py::test_sha_mismatch_writes_nothing``,
``test_adapters.py::test_watcher_loads_the_newest_published_adapter_then_follows_live``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import subprocess
from pathlib import Path

import asyncpg
import nats
import numpy as np
import pytest
from nats.js.api import ConsumerConfig, KeyValueConfig
from safetensors.numpy import save_file

from artery.schemas import CheckpointSaved, TrainRequested, new_event_id
from artery.services.inference.checkpoints import CheckpointWatcher
from artery.services.inference.control import ControlServer, ReplicaRegistry
from artery.services.inference.pause import PauseGate
from artery.services.publisher.base_models import BaseModelPolicy
from artery.services.publisher.registry import RegistryServer
from artery.shared import bus, subjects
from artery.shared.adapters import get_adapter, pack_adapter, put_adapter
from artery.shared.auth import nats_connect_options
from artery.shared.consumer import ConsumerOptions, DurableConsumer
from artery.shared.control_client import live_replicas, pause_replicas, resume_replicas
from artery.shared.db import migrations
from artery.shared.embedded import NatsServer, nats_server_binary
from artery.shared.errors import ConfigError
from artery.shared.permissions import (
    DURABLES,
    ROLES,
    TRAINER_CONSUMER,
    NatsUser,
    default_users,
    permissions,
    provision_if_missing,
    render_authorization,
)
from artery.shared.registry import models_kv, project_replicas
from artery.shared.settings import CommonSettings
from tests.factories import group
from tests.test_publisher import published_event

PROJECT, OTHER, MODEL = "alpha", "beta", "agent"
#: How long a refused request is given before it counts as dropped (the server says why at once).
DENIED_WAIT_S = 0.25


# --------------------------------------------------------------------------- the generated config


def test_permissions_follow_the_subjects_module():
    agent = permissions("agent", "agent-alpha", project=PROJECT)
    assert subjects.trajectories(PROJECT, ">") in agent.publish
    assert not any(OTHER in s for s in agent.publish + agent.subscribe)
    assert agent.subscribe == (
        subjects.train("*", PROJECT, ">"),
        subjects.kv_updates(subjects.REPLICAS_BUCKET, f"{PROJECT}.>"),  # its replicas' entries
        "_INBOX.agent-alpha.>",
    )
    for role in ROLES:
        p = permissions(role, role, project=PROJECT if role == "agent" else None)
        pause, resume = subjects.control("pause", "*", "*"), subjects.control("resume", "*", "*")
        controls = {s for s in p.publish if s.startswith(f"{subjects.PREFIX}.control.inference")}
        # Only the trainer pauses; the admin (an operator, through the console) may also resume.
        assert controls == {"trainer": {pause, resume}, "admin": {resume}}.get(role, set()), role
        denied = {f"{subjects.PREFIX}.control.inference.>", pause} & set(p.deny_publish)
        assert bool(denied) == (role != "trainer"), role
        writes = any(s.startswith(f"$O.{subjects.ADAPTERS_BUCKET}") for s in p.publish)
        assert writes == (role == "publisher"), role
        assert (f"$O.{subjects.ADAPTERS_BUCKET}.>" in p.deny_publish) == (role != "publisher"), role
        assert not any(s in ("_INBOX.>", ">") for s in p.subscribe) or role == "admin"
    # The trainer's durable is named in the trainer (not importable cheaply: torch); keep them equal.
    source = Path(__file__).parent.parent / "services" / "trainer" / "service.py"
    assert f'TRAINER_CONSUMER = "{TRAINER_CONSUMER}"' in source.read_text()
    assert DURABLES["trainer"][1] == TRAINER_CONSUMER


def test_users_are_validated():
    with pytest.raises(ValueError, match="unknown role"):
        NatsUser("x", "root", "pw")
    with pytest.raises(ValueError, match="must match"):
        NatsUser("..", "collector", "pw")  # a dot inside is escaped in the inbox; alone it is refused
    with pytest.raises(ValueError, match="project"):
        NatsUser("agent-x", "agent", "pw")
    with pytest.raises(ValueError, match="quote"):
        NatsUser("collector", "collector", 'p"w')
    with pytest.raises(ValueError, match="unique"):
        render_authorization([NatsUser("c", "collector", "a"), NatsUser("c", "reward", "b")])


# --------------------------------------------------------------------------- a secured server


class Client:
    """A connection as one user, through the same options ``bus.connect`` uses; errors recorded."""

    def __init__(self, nc: nats.NATS, errors: list[str]):
        self.nc, self.errors = nc, errors
        self.js = nc.jetstream(timeout=10)

    async def denied(self, subject_prefix: str, action=None, *, what: str = "Publish") -> None:
        """Run ``action`` (it may time out: the server drops what it denies) and expect the
        server's permissions violation naming a subject that starts with ``subject_prefix``."""
        if action is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(action, DENIED_WAIT_S * 4)
        with contextlib.suppress(Exception):
            await self.nc.flush(timeout=1)
        # nats-py lower-cases the server's message, subject included.
        needle = f'permissions violation for {what} to "{subject_prefix}'.lower()
        for _ in range(250):
            if any(needle in e.lower() for e in self.errors):
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"no violation {needle!r}; errors: {self.errors}")

    def clean(self) -> None:
        assert not [e for e in self.errors if "permissions violation" in e.lower()], self.errors


class Secured:
    def __init__(self, server: NatsServer, users: list[NatsUser]):
        self.server = server
        self.passwords = {u.name: u.password for u in users}
        self.settings = CommonSettings(nats_url=server.url)
        self.clients: list[nats.NATS] = []

    def environ(self, user: str) -> dict[str, str]:
        return {"ARTERY_NATS_USER": user, "ARTERY_NATS_PASSWORD": self.passwords[user]}

    async def connect(self, user: str) -> Client:
        errors: list[str] = []

        async def on_error(exc):
            errors.append(str(exc))

        nc = await nats.connect(
            self.server.url,
            allow_reconnect=False,
            error_cb=on_error,
            **nats_connect_options(self.settings, self.environ(user)),
        )
        self.clients.append(nc)
        return Client(nc, errors)


@pytest.fixture
async def secured(tmp_path):
    users = default_users([PROJECT, OTHER])
    server = NatsServer(tmp_path / "nats", extra_config=render_authorization(users)).start()
    s = Secured(server, users)
    try:
        admin = await s.connect("admin")
        await bus.provision(admin.js, s.settings)
        admin.clean()
        yield s
    finally:
        for nc in s.clients:
            with contextlib.suppress(Exception):
                await nc.close()
        server.stop()


def saved_event(project: str = PROJECT) -> CheckpointSaved:
    return CheckpointSaved(
        id=new_event_id(),
        project=project,
        model=MODEL,
        step=1,
        uri="file:///ckpt/1",
        sha256="0" * 64,
        size_bytes=1,
        base_model="tiny",
    )


async def test_agent_publishes_for_its_project_and_nothing_else(secured):
    agent = await secured.connect(f"agent-{PROJECT}")
    ack = await bus.publish_event(agent.js, subjects.trajectories(PROJECT, MODEL), group(PROJECT, MODEL))
    assert ack.stream == subjects.TRAJECTORIES.name
    request = TrainRequested(id=new_event_id(), project=PROJECT, model=MODEL, group_ids=["g"])
    await bus.publish_event(agent.js, subjects.train("requested", PROJECT, MODEL), request)
    models = models_kv(agent.js)  # get_step(); register() asks the publisher
    publisher = await secured.connect("publisher")  # the registry's writer
    await (await publisher.js.key_value(subjects.MODELS_BUCKET)).put(
        subjects.model_key(PROJECT, MODEL), b"{}"
    )
    assert (await models.get(subjects.model_key(PROJECT, MODEL))).value == b"{}"
    assert not await provision_if_missing(agent.js, secured.settings)  # what the SDK checks on connect
    agent.clean()

    other = subjects.trajectories(OTHER, MODEL)
    pause = subjects.control("pause", PROJECT, MODEL)
    saved = subjects.checkpoint("saved", PROJECT, MODEL)
    published = subjects.checkpoint("published", PROJECT, MODEL)
    chunk = f"$O.{subjects.ADAPTERS_BUCKET}.C.x"
    stream, durable, _ = DURABLES["collector"]
    await asyncio.gather(
        agent.denied(other, bus.publish_event(agent.js, other, group(OTHER, MODEL))),
        agent.denied(f"$KV.{subjects.MODELS_BUCKET}.{OTHER}.", models.put(f"{OTHER}.{MODEL}", b"{}")),
        # Not even its own records: a KV stream honours Nats-Rollup (the publisher writes them).
        agent.denied(f"$KV.{subjects.MODELS_BUCKET}.{PROJECT}.", models.put(f"{PROJECT}.{MODEL}", b"{}")),
        # Nor a consumer of its own: the publisher lists its replicas on its behalf.
        agent.denied(
            f"$JS.API.CONSUMER.CREATE.KV_{subjects.REPLICAS_BUCKET}.", live_replicas(agent.js, PROJECT, MODEL)
        ),
        agent.denied(f"$JS.API.STREAM.INFO.{stream.name}", agent.js.stream_info(stream.name)),
        agent.denied(pause, agent.nc.publish(pause, b"{}")),
        agent.denied(saved, bus.publish_event(agent.js, saved, saved_event())),
        agent.denied(published, agent.nc.publish(published, b"{}")),
        # An object store put: refused at its first step (reading what is there), and its chunks too.
        agent.denied(
            f"$JS.API.STREAM.MSG.GET.OBJ_{subjects.ADAPTERS_BUCKET}", put_adapter(agent.js, "x", b"x")
        ),
        agent.denied(chunk, agent.nc.publish(chunk, b"x")),
        # Reading what others publish, or the replies others get, is refused too.
        agent.denied("artery.traj.>", agent.nc.subscribe(stream.subjects[0]), what="Subscription"),
        agent.denied("_INBOX.>", agent.nc.subscribe("_INBOX.>"), what="Subscription"),
        agent.denied(
            f"$JS.API.CONSUMER.INFO.{stream.name}.{durable}",
            agent.js.pull_subscribe(stream.subjects[0], durable=durable, stream=stream.name),
        ),
        agent.denied("$JS.API.STREAM.CREATE.", bus.provision(agent.js, secured.settings)),
        # Stream and consumer administration: another tenant's consumer (a replica lookup in
        # flight) or stream is never an agent's to remove, empty or change.
        agent.denied(
            f"$JS.API.CONSUMER.DELETE.KV_{subjects.REPLICAS_BUCKET}.read_",
            agent.js.delete_consumer(f"KV_{subjects.REPLICAS_BUCKET}", "read_0123456789abcdef"),
        ),
        agent.denied(
            f"$JS.API.CONSUMER.DELETE.{stream.name}.{durable}", agent.js.delete_consumer(stream.name, durable)
        ),
        agent.denied(f"$JS.API.STREAM.DELETE.{stream.name}", agent.js.delete_stream(stream.name)),
        agent.denied(f"$JS.API.STREAM.PURGE.{stream.name}", agent.js.purge_stream(stream.name)),
        agent.denied(f"$JS.API.STREAM.MSG.DELETE.{stream.name}", agent.js.delete_msg(stream.name, 1)),
        agent.denied(
            f"$JS.API.STREAM.UPDATE.{stream.name}",
            agent.js.update_stream(bus.stream_config(subjects.TRAJECTORIES, secured.settings)),
        ),
    )


async def test_agent_reads_its_own_projects_models_and_replicas_only(secured):
    """Model records and replica heartbeats of another project (its base model, its replicas'
    URLs) are not an agent's to read: direct gets and key listings are scoped by subject."""
    inference = await secured.connect("inference")
    gate = PauseGate(max_wait_s=5)
    registries = [
        ReplicaRegistry(
            inference.js, gate, replica_id=f"r-{p}", project=p, model=MODEL, engine="fake", url=f"http://{p}"
        )
        for p in (PROJECT, OTHER)
    ]
    for registry in registries:
        await registry.start()
    publisher = await secured.connect("publisher")
    server = RegistryServer(publisher.nc, BaseModelPolicy.parse(None, None, authenticated=True))
    await server.start()
    try:
        for project in (PROJECT, OTHER):
            agent = await secured.connect(f"agent-{project}")
            models = models_kv(agent.js)
            await (await publisher.js.key_value(subjects.MODELS_BUCKET)).put(
                subjects.model_key(project, MODEL), project.encode()
            )
            assert (await models.get(subjects.model_key(project, MODEL))).value == project.encode()
            replicas = await project_replicas(agent.js, project, MODEL)  # answered by the publisher
            assert [r.url for r in replicas] == [f"http://{project}"]
            agent.clean()

        agent = await secured.connect(f"agent-{PROJECT}")
        models = models_kv(agent.js)
        await asyncio.gather(
            agent.denied(
                f"$JS.API.DIRECT.GET.KV_{subjects.MODELS_BUCKET}.$KV.{subjects.MODELS_BUCKET}.{OTHER}.",
                models.get(subjects.model_key(OTHER, MODEL)),
            ),
            agent.denied(
                f"$JS.API.CONSUMER.CREATE.KV_{subjects.REPLICAS_BUCKET}.",
                live_replicas(agent.js, OTHER, MODEL),
            ),
            agent.denied(
                subjects.replicas_request(OTHER, MODEL),
                agent.nc.request(subjects.replicas_request(OTHER, MODEL), b"", timeout=DENIED_WAIT_S),
            ),
            # nats.py's own watch: refused at its first step (the bucket's info, whose
            # subjects_filter would list every key) and its consumer, whose filter is in the body.
            agent.denied(
                f"$JS.API.STREAM.INFO.KV_{subjects.REPLICAS_BUCKET}",
                agent.js.key_value(subjects.REPLICAS_BUCKET),
            ),
            agent.denied(
                f"$JS.API.CONSUMER.CREATE.KV_{subjects.REPLICAS_BUCKET}",
                agent.js.add_consumer(
                    f"KV_{subjects.REPLICAS_BUCKET}", ConsumerConfig(deliver_subject=agent.nc.new_inbox())
                ),
            ),
            # Hearing another project's replicas change (train() listens to its own) is refused.
            agent.denied(
                f"$KV.{subjects.REPLICAS_BUCKET}.{OTHER}.",
                agent.nc.subscribe(subjects.kv_updates(subjects.REPLICAS_BUCKET, f"{OTHER}.>")),
                what="Subscription",
            ),
        )
        # Its own replicas' entries it hears as they are written.
        own = await agent.nc.subscribe(subjects.kv_updates(subjects.REPLICAS_BUCKET, f"{PROJECT}.>"))
        await agent.nc.flush()
        await registries[0].beat()
        heard = await own.next_msg(timeout=5)
        entry = subjects.replica_key(PROJECT, MODEL, "r-alpha")
        assert heard.subject == subjects.kv_updates(subjects.REPLICAS_BUCKET, entry)
        # The trainer reads every project's replicas: it pauses them all.
        trainer = await secured.connect("trainer")
        for project in (PROJECT, OTHER):
            assert [r.replica_id for r in await live_replicas(trainer.js, project, MODEL)] == [f"r-{project}"]
        trainer.clean()
    finally:
        await server.stop()
        for registry in registries:
            await registry.stop()


async def test_only_the_trainer_pauses_inference(secured):
    inference = await secured.connect("inference")
    gate = PauseGate(max_wait_s=5)
    control = ControlServer(inference.nc, gate, replica_id="r1", project=PROJECT, model=MODEL)
    registry = ReplicaRegistry(
        inference.js, gate, replica_id="r1", project=PROJECT, model=MODEL, engine="fake", url="http://x"
    )
    await control.start()
    await registry.start()
    try:
        trainer = await secured.connect("trainer")
        outcome = await pause_replicas(
            trainer.nc, PROJECT, MODEL, lease_seconds=30, requested_by="trainer", timeout_s=5
        )
        assert outcome.ok and list(outcome.acked) == ["r1"] and gate.paused
        resumed = await resume_replicas(trainer.nc, PROJECT, MODEL, outcome.lease_id, requested_by="trainer")
        assert list(resumed.acked) == ["r1"] and not gate.paused
        await inference.nc.publish(subjects.dead_letter("inference"), b"{}")  # its control dead letters
        trainer.clean()
        inference.clean()

        pause = subjects.control("pause", PROJECT, MODEL)
        for user in ("admin", f"agent-{PROJECT}", "collector", "reward", "publisher", "inference"):
            client = await secured.connect(user)
            await client.denied(pause, client.nc.publish(pause, b"{}"))
        assert not gate.paused
        # A replica answers the trainer on its inbox, and nowhere else.
        await inference.denied("_INBOX.trainer.", inference.nc.publish("_INBOX.trainer.x", b"forged ack"))
    finally:
        await registry.stop()
        await control.stop()


class RecordingEngine:
    def __init__(self):
        self.loaded: list[str] = []

    async def load_adapter(self, name: str, path) -> None:
        self.loaded.append(name)

    async def unload_adapter(self, name: str) -> None:
        self.loaded.remove(name)


async def test_only_the_publisher_writes_adapters_and_inference_reads_them(secured, tmp_path):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 1}')
    save_file(
        {"lora_A.weight": np.zeros((1, 4), dtype=np.float32)}, str(adapter / "adapter_model.safetensors")
    )
    data = pack_adapter(adapter)
    name = f"{PROJECT}/{MODEL}/step-1"

    inference = await secured.connect("inference")
    engine = RecordingEngine()
    watcher = CheckpointWatcher(
        inference.js, PROJECT, MODEL, engine, lambda step, served: None, cache_dir=tmp_path / "cache"
    )
    await watcher.start()  # follows checkpoint.published by subscribing, reads the last by direct get
    try:
        publisher = await secured.connect("publisher")
        await put_adapter(publisher.js, name, data)
        published = published_event(name, data, 1, project=PROJECT, model=MODEL)
        await bus.publish_event(publisher.js, subjects.checkpoint("published", PROJECT, MODEL), published)
        for _ in range(250):
            if engine.loaded:
                break
            await asyncio.sleep(0.02)
        assert engine.loaded == [f"{MODEL}@1"]  # fetched from the object store and verified
    finally:
        await watcher.stop()
    assert await get_adapter(inference.js, name) == data
    inference.clean()
    publisher.clean()

    others = [await secured.connect(u) for u in ("inference", "admin", "trainer", "collector", "reward")]
    await asyncio.gather(
        *(
            # Readers of the bucket are refused its chunks; the others are refused reading it.
            client.denied(
                f"$O.{subjects.ADAPTERS_BUCKET}.C." if i < 2 else "$JS.API.STREAM.MSG.GET.OBJ_",
                put_adapter(client.js, f"{PROJECT}/{MODEL}/step-2", b"evil"),
            )
            for i, client in enumerate(others)
        )
    )
    # A short timeout: a refused delete still purges the chunks, and waits for that to be refused too.
    store = await inference.nc.jetstream(timeout=DENIED_WAIT_S).object_store(subjects.ADAPTERS_BUCKET)
    await inference.denied(f"$O.{subjects.ADAPTERS_BUCKET}.M.", store.delete(name))
    assert await get_adapter(publisher.js, name) == data

    # A replica that starts after the publication loads it from the last message (a direct get).
    late = RecordingEngine()
    watcher = CheckpointWatcher(
        inference.js, PROJECT, MODEL, late, lambda step, served: None, cache_dir=tmp_path / "late"
    )
    await watcher.start()
    try:
        for _ in range(250):
            if late.loaded:
                break
            await asyncio.sleep(0.02)
        assert late.loaded == [f"{MODEL}@1"]
    finally:
        await watcher.stop()
    # Inference creates no consumer on the checkpoints stream, where the publisher's durable is:
    # with that permission it could change the durable's settings.
    checkpoints = subjects.CHECKPOINTS.name
    await inference.denied(
        f"$JS.API.CONSUMER.CREATE.{checkpoints}",
        inference.js.add_consumer(checkpoints, ConsumerConfig(name="spy", deliver_subject="spy")),
    )
    # Nor on the adapters' stream: it reads chunks message by message.
    await inference.denied(
        f"$JS.API.CONSUMER.CREATE.OBJ_{subjects.ADAPTERS_BUCKET}",
        inference.js.add_consumer(f"OBJ_{subjects.ADAPTERS_BUCKET}", ConsumerConfig(name="spy")),
    )


async def test_every_service_runs_its_consumer_under_its_own_user(secured):
    """The pipeline's hand-offs, each service with its real durable consumer, acks and dead letters."""
    clients = {role: await secured.connect(role) for role in DURABLES}
    agent = await secured.connect(f"agent-{PROJECT}")
    outcomes = await agent.nc.subscribe(subjects.train("*", PROJECT, ">"))
    seen: dict[str, list[str]] = {role: [] for role in DURABLES}

    async def forward(role: str, msgs):
        js = clients[role].js
        for msg in msgs:
            seen[role].append(msg.subject)
            if role == "collector":
                await js.publish(subjects.group_ready(PROJECT, MODEL), b"{}")
            elif role == "reward":
                await js.publish(subjects.group_scored(PROJECT, MODEL), b"{}")
            elif role == "trainer":
                await js.publish(subjects.checkpoint("saved", PROJECT, MODEL), b"{}")
                await js.publish(subjects.train("completed", PROJECT, MODEL), b"{}")
            elif role == "publisher":
                await put_adapter(js, f"{PROJECT}/{MODEL}/step-1", b"adapter")
                await js.publish(subjects.checkpoint("published", PROJECT, MODEL), b"{}")
        return [None] * len(msgs)

    consumers = []
    for role, (stream, durable, filter_subject) in DURABLES.items():
        consumer = DurableConsumer(
            clients[role].js,
            service=role,
            stream=stream,
            durable=durable,
            filter_subject=filter_subject,
            handler=lambda msgs, role=role: forward(role, msgs),
            options=ConsumerOptions(fetch_timeout_s=0.1),
        )
        await consumer.start()
        consumers.append(consumer)
    tasks = [asyncio.create_task(c.run()) for c in consumers]
    try:
        await agent.js.publish(subjects.trajectories(PROJECT, MODEL), b"{}")
        await agent.js.publish(subjects.train("requested", PROJECT, MODEL), b"{}")
        for _ in range(250):
            if all(seen.values()):
                break
            await asyncio.sleep(0.02)
        assert seen == {
            "collector": [subjects.trajectories(PROJECT, MODEL)],
            "reward": [subjects.group_ready(PROJECT, MODEL)],
            "trainer": [subjects.train("requested", PROJECT, MODEL)],
            "publisher": [subjects.checkpoint("saved", PROJECT, MODEL)],
        }
        kinds = [(await outcomes.next_msg(timeout=2)).subject for _ in range(2)]
        assert kinds == [
            subjects.train("requested", PROJECT, MODEL),
            subjects.train("completed", PROJECT, MODEL),
        ]
        for role, client in clients.items():  # each may dead-letter, under its own name only
            await client.js.publish(subjects.dead_letter(role), b"{}")
            client.clean()
            other = subjects.dead_letter("inference" if role != "inference" else "collector")
            await client.denied(other, client.nc.publish(other, b"{}"))
        # Another service's durable consumer is out of reach: it cannot be bound, changed or deleted.
        stream, durable, filter_subject = DURABLES["publisher"]
        reward = clients["reward"]
        await reward.denied(
            f"$JS.API.CONSUMER.INFO.{stream.name}.{durable}",
            reward.js.pull_subscribe(filter_subject, durable=durable, stream=stream.name),
        )
        await reward.denied(
            f"$JS.API.CONSUMER.DELETE.{stream.name}.{durable}",
            reward.js.delete_consumer(stream.name, durable),
        )

        # The SDK's delete_checkpoints(): a request to the publisher, for the agent's project only.
        async def retain(msg):
            await msg.respond(b"done")

        retention = await clients["publisher"].nc.subscribe(
            subjects.retention_request("*", "*"), queue="publisher", cb=retain
        )
        await clients["publisher"].nc.flush()
        # ci-fresh saw one "no responders" here, on a machine loaded far past CI's, once in six runs:
        # the publisher's subscription (flushed, so the server had it) was not matched. Until the
        # cause is known, the answer is waited for as the readiness signal it is — bounded, and the
        # publisher's connection and its server errors are named if it is gone.
        for _ in range(50):
            try:
                reply = await agent.nc.request(subjects.retention_request(PROJECT, MODEL), b"{}", timeout=2)
                break
            except nats.errors.NoRespondersError:
                publisher = clients["publisher"]
                assert publisher.nc.is_connected, f"publisher disconnected: {publisher.errors}"
                await publisher.nc.flush()
        assert reply.data == b"done"
        agent.clean()
        other = subjects.retention_request(OTHER, MODEL)
        await agent.denied(other, agent.nc.request(other, b"{}", timeout=DENIED_WAIT_S))
        await retention.unsubscribe()
    finally:
        for consumer in consumers:
            consumer.stop()
        await asyncio.gather(*tasks)


async def test_trainer_advances_steps_and_reads_replicas(secured):
    admin = await secured.connect("admin")
    trainer = await secured.connect("trainer")
    models = await trainer.js.key_value(subjects.MODELS_BUCKET)
    revision = await models.put(subjects.model_key(OTHER, MODEL), b'{"step": 0}')
    await models.update(subjects.model_key(OTHER, MODEL), b'{"step": 1}', last=revision)
    status = await admin.js.key_value(subjects.MODELS_BUCKET)  # what `artery status` reads
    assert (await status.get(subjects.model_key(OTHER, MODEL))).value == b'{"step": 1}'
    trainer.clean()
    # Only the admin changes buckets and streams.
    await trainer.denied(
        "$JS.API.STREAM.CREATE.KV_x", trainer.js.create_key_value(KeyValueConfig(bucket="x"))
    )
    await admin.js.create_key_value(KeyValueConfig(bucket="x"))
    admin.clean()


async def test_provision_if_missing_provisions_a_fresh_server_once(tmp_path):
    with NatsServer(tmp_path / "nats") as server:
        settings = CommonSettings(nats_url=server.url)
        nc = await bus.connect(settings, "t")
        try:
            assert await provision_if_missing(nc.jetstream(), settings)
            assert not await provision_if_missing(nc.jetstream(), settings)
        finally:
            await nc.close()


# --------------------------------------------------------------------------- credentials


def test_connect_options_from_the_environment(tmp_path):
    settings = CommonSettings(nats_url="nats://127.0.0.1:1", nats_creds="/run/secrets/nats.creds")
    assert nats_connect_options(CommonSettings(), {}) == {}
    secret = tmp_path / "password"
    secret.write_text("s3cret\n")
    options = nats_connect_options(
        settings, {"ARTERY_NATS_USER": "collector", "ARTERY_NATS_PASSWORD_FILE": str(secret)}
    )
    assert options == {
        "user_credentials": "/run/secrets/nats.creds",
        "user": "collector",
        "password": "s3cret",
        "inbox_prefix": "_INBOX.collector",
    }
    assert nats_connect_options(CommonSettings(), {"ARTERY_NATS_TOKEN": "t"}) == {"token": "t"}
    for environ, match in [
        ({"ARTERY_NATS_USER": "u"}, "needs ARTERY_NATS_PASSWORD"),
        ({"ARTERY_NATS_PASSWORD": "p"}, "needs ARTERY_NATS_PASSWORD"),
        ({"ARTERY_NATS_USER": "u", "ARTERY_NATS_PASSWORD": "p", "ARTERY_NATS_TOKEN": "t"}, "not both"),
        ({"ARTERY_NATS_PASSWORD": "p", "ARTERY_NATS_PASSWORD_FILE": str(secret)}, "not both"),
        ({"ARTERY_NATS_USER": "u", "ARTERY_NATS_PASSWORD_FILE": str(tmp_path / "nope")}, "cannot read"),
        ({"ARTERY_NATS_TLS_CERT": str(secret)}, "go together"),
        ({"ARTERY_NATS_TLS_CA": str(secret)}, "TLS files"),
    ]:
        with pytest.raises(ConfigError, match=match):
            nats_connect_options(CommonSettings(), environ)


async def test_bus_connect_uses_password_file_and_refuses_wrong_credentials(secured, tmp_path, monkeypatch):
    secret = tmp_path / "collector.password"
    secret.write_text(secured.passwords["collector"] + "\n")
    monkeypatch.setenv("ARTERY_NATS_USER", "collector")
    monkeypatch.setenv("ARTERY_NATS_PASSWORD_FILE", str(secret))
    nc = await bus.connect(secured.settings, "collector")
    try:
        sub = await nc.subscribe(nc.new_inbox())  # the inbox prefix its permissions allow
        assert sub.subject.startswith("_INBOX.collector.")
        await nc.flush()
    finally:
        await nc.close()
    for environ in ({}, {"ARTERY_NATS_USER": "collector", "ARTERY_NATS_PASSWORD": "wrong"}):
        with pytest.raises(Exception, match=r"[Aa]uthorization"):
            await nats.connect(
                secured.server.url,
                allow_reconnect=False,
                max_reconnect_attempts=0,
                **nats_connect_options(secured.settings, environ),
            )


async def test_token(tmp_path, monkeypatch):
    with NatsServer(tmp_path / "nats", extra_config='authorization { token: "t0ken" }') as server:
        settings = CommonSettings(nats_url=server.url)
        with pytest.raises(Exception, match=r"[Aa]uthorization"):
            await nats.connect(server.url, allow_reconnect=False, max_reconnect_attempts=0)
        monkeypatch.setenv("ARTERY_NATS_TOKEN", "t0ken")
        nc = await bus.connect(settings, "t")
        await nc.flush()
        await nc.close()


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_certificates(directory: Path) -> None:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, all throw-away."""
    directory.mkdir()
    curve = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *curve, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
             "-subj", "/CN=artery test CA", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=directory)  # fmt: skip
    for name, usage, san in (
        ("server", "serverAuth", "subjectAltName=IP:127.0.0.1"),
        ("client", "clientAuth", ""),
    ):
        _openssl("req", *curve, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}",
                 cwd=directory)  # fmt: skip
        (directory / f"{name}.ext").write_text(
            f"basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage={usage}\n"
            f"subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n{san}\n"
        )
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", f"{name}.pem", "-days", "1", "-extfile", f"{name}.ext",
                 cwd=directory)  # fmt: skip


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
async def test_mutual_tls(tmp_path, monkeypatch):
    certs = tmp_path / "certs"
    make_certificates(certs)
    tls = {
        "cert_file": str(certs / "server.pem"),
        "key_file": str(certs / "server.key"),
        "ca_file": str(certs / "ca.pem"),
    }
    config = "tls { " + ", ".join(f"{k}: {json.dumps(v)}" for k, v in tls.items()) + ", verify: true }"
    with NatsServer(tmp_path / "nats", extra_config=config) as server:
        settings = CommonSettings(nats_url=server.url)
        monkeypatch.setenv("ARTERY_NATS_TLS_CA", str(certs / "ca.pem"))
        # The server wants a client certificate: the CA alone is not enough.
        with pytest.raises(Exception):  # noqa: B017 - the TLS alert surfaces in several types
            await nats.connect(
                server.url, allow_reconnect=False, max_reconnect_attempts=0, **nats_connect_options(settings)
            )
        monkeypatch.setenv("ARTERY_NATS_TLS_CERT", str(certs / "client.pem"))
        monkeypatch.setenv("ARTERY_NATS_TLS_KEY", str(certs / "client.key"))
        nc = await bus.connect(settings, "t")
        try:
            await bus.provision(nc.jetstream(), settings)
            assert nc.connected_url is not None and nc._server_info.get("tls_required")
        finally:
            await nc.close()


# --------------------------------------------------------------------------- PostgreSQL roles


async def test_collector_role_may_insert_but_not_delete_or_drop(db):
    async with db.transaction():
        await db.execute("SET LOCAL ROLE artery_collector")
        await db.execute(
            "INSERT INTO trajectory_groups (id, project, model, split, num_trajectories, num_exceptions,"
            " reward_mean, needs_reward, submitted_at, metadata, metrics, exceptions, logs)"
            " VALUES ('g1', 'p', 'm', 'train', 0, 0, 0, false, now(), '{}', '{}', '[]', '[]')"
        )
        assert await db.fetchval("SELECT count(*) FROM trajectory_groups") == 1
    for statement in (
        "DELETE FROM trajectory_groups",
        "DROP TABLE trajectories",
        "TRUNCATE trajectory_groups CASCADE",
        "UPDATE trajectory_groups SET reward_mean = 1",
        "SELECT * FROM checkpoints",
        "CREATE TABLE evil (x int)",
    ):
        with pytest.raises(asyncpg.exceptions.InsufficientPrivilegeError):
            async with db.transaction():
                await db.execute("SET LOCAL ROLE artery_collector")
                await db.execute(statement)
    assert await db.fetchval("SELECT count(*) FROM trajectory_groups") == 1


async def test_reader_role_only_reads_and_each_service_role_gets_what_it_writes(db):
    privileges = {
        (r["grantee"], r["table_name"], r["privilege_type"])
        for r in await db.fetch(
            "SELECT grantee, table_name, privilege_type FROM information_schema.role_table_grants"
            " WHERE grantee LIKE 'artery\\_%'"
        )
    }
    reader = {(t, p) for g, t, p in privileges if g == "artery_reader"}
    assert {p for _, p in reader} == {"SELECT"}
    assert {t for t, _ in reader} >= {"trajectory_groups", "trajectories", "checkpoints", "training_steps"}
    assert ("artery_publisher", "checkpoints", "UPDATE") in privileges
    assert ("artery_trainer", "training_steps", "INSERT") in privileges
    assert ("artery_reward", "group_rewards", "INSERT") in privileges
    assert not {p for _, _, p in privileges} & {"DELETE", "TRUNCATE", "REFERENCES", "TRIGGER"}


async def test_roles_migration_is_idempotent(db):
    sql = next(sql for _, name, sql in migrations() if name == "roles")
    await db.execute(sql)  # the roles exist (made by this or another database): nothing fails
    await db.execute(sql)
    assert await db.fetchval("SELECT count(*) FROM pg_roles WHERE rolname LIKE 'artery\\_%'") >= 5


async def test_role_passwords_are_never_set_by_migrations(db):
    rows = await db.fetch("SELECT rolname, rolcanlogin FROM pg_roles WHERE rolname LIKE 'artery\\_%'")
    assert rows and not any(r["rolcanlogin"] for r in rows)


def test_rendered_config_is_what_nats_server_reads(tmp_path):
    users = default_users([PROJECT], password=lambda: "pw")
    text = render_authorization(users)
    assert 'user: "agent-alpha", password: "$2a$' in text and '"pw"' not in text  # a bcrypt hash
    assert '"artery.traj.alpha.>"' in text and "allow_responses: true" in text
    config = tmp_path / "nats.conf"
    config.write_text(text)
    check = subprocess.run([nats_server_binary(), "-t", "-c", str(config)], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr + check.stdout
