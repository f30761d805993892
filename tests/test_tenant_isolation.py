"""A hostile tenant on a secure stack (``Stack(secure=True)``, two projects): with raw nats-py
calls, the agent of ``hostile`` tries what an agent's credentials once allowed against
``other``, and ``other``'s work goes on through the SDK's own paths.

One stack for the module (collector and publisher, the services these findings involve): each
test connects its own clients, and names its own model, so none depends on another's data.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path

import asyncpg
import msgspec
import pytest
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import APIError

import artery as art
from artery.ops.stack import Stack
from artery.schemas import ModelRecord
from artery.services.publisher.base_models import EMBEDDED, BaseModelPolicy
from artery.shared import bus, subjects
from artery.shared.bus import MSG_ID, event_headers
from artery.shared.codec import encode
from artery.shared.errors import InvalidMessage
from artery.shared.models import TINY
from artery.shared.permissions import permissions
from artery.shared.registry import RegistrationRefused, models_kv, read_record, register
from tests.factories import group
from tests.helpers import wait_for
from tests.test_secure_stack import _password, connect
from tests.test_security import DENIED_WAIT_S, Client
from tests.test_tenants import letters

HOSTILE, OTHER = "hostile", "other"
ROLLUP = "Nats-Rollup"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    home = tmp_path_factory.mktemp("tenants") / "stack"
    s = Stack(home=home, secure=True, projects=(HOSTILE, OTHER), services=("collector", "publisher"))
    s.start()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture
async def clients(stack):
    opened: list[Client] = []

    async def open_as(who: str) -> Client:
        environ = (
            stack.agent_env(who)
            if who in (HOSTILE, OTHER)
            else {"ARTERY_NATS_USER": who, **_password(stack, who)}
        )
        client = await connect(stack, environ)
        opened.append(client)
        return client

    yield open_as
    for client in opened:
        with contextlib.suppress(Exception):
            await client.nc.close()


@pytest.fixture
async def sdk(stack, monkeypatch):
    """``art.Backend`` connected as ``other``'s agent, as an agent program would be."""
    for key, value in stack.agent_env(OTHER).items():
        monkeypatch.setenv(key, value)
    backend = art.Backend(nats_url=stack.nats_url)
    try:
        yield backend
    finally:
        await backend.close()


def _overlap(a: str, b: str) -> bool:
    """Whether some subject matches both NATS patterns."""
    x, y = a.split("."), b.split(".")
    for i, (s, t) in enumerate(zip(x, y, strict=False)):
        if ">" in (s, t):
            return True
        if "*" not in (s, t) and s != t:
            return False
        if i == min(len(x), len(y)) - 1:
            return len(x) == len(y)
    return False


async def test_a_rollup_publish_is_refused_and_the_other_tenants_model_still_registers(stack, clients, sdk):
    model = art.TrainableModel(name="rolled", project=OTHER, base_model=TINY, lora_config={"rank": 4})
    await model.register(sdk)
    hostile = await clients(HOSTILE)
    # The publish that once purged the whole bucket, every project's records included.
    own_key = subjects.kv_updates(subjects.MODELS_BUCKET, f"{HOSTILE}.rolled")
    await hostile.denied(
        own_key, hostile.nc.request(own_key, b"", headers={ROLLUP: "all"}, timeout=DENIED_WAIT_S)
    )
    # Where an agent may publish into a stream, that stream refuses a rollup header.
    with pytest.raises(APIError, match="rollup"):
        await hostile.js.publish(
            subjects.trajectories(HOSTILE, "rolled"),
            encode(group(HOSTILE, "rolled")),
            headers={ROLLUP: "all"},
        )
    # ... and so does every stream an agent's permissions reach, whatever the project.
    admin = await clients("admin")
    agent_publishes = permissions("agent", f"agent-{HOSTILE}", project=HOSTILE).publish
    reachable = []
    for info in await admin.js.streams_info():
        if any(_overlap(p, s) for p in agent_publishes for s in info.config.subjects or ()):
            reachable.append(info.config.name)
            assert not info.config.allow_rollup_hdrs, info.config.name
    assert sorted(reachable) == sorted([subjects.TRAJECTORIES.name, subjects.TRAINING.name])

    found = await read_record(models_kv((await sdk._connect()).jetstream()), OTHER, "rolled")
    assert found is not None and found.record.lora.rank == 4 and found.record.base_model == TINY
    await model.register(sdk)  # and registering again still works, through the publisher
    assert await model.get_step() == 0
    # The registry takes base models from its allow-list only: never a path an agent chose.
    for base in ("/etc/shadow", str(stack.home), "../../etc"):
        bad = ModelRecord(project=HOSTILE, name="pathy", base_model=base, trainable=True)
        with pytest.raises(RegistrationRefused, match="base_model"):
            await register(hostile.js, bad)
    # Nor a record of another project, even by asking the registry.
    forged = msgspec.json.encode(ModelRecord(project=OTHER, name="rolled", base_model=TINY))
    await hostile.denied(
        subjects.register_request(OTHER, "rolled"),
        hostile.nc.request(subjects.register_request(OTHER, "rolled"), forged, timeout=DENIED_WAIT_S),
    )
    assert (await read_record(await admin.js.key_value(subjects.MODELS_BUCKET), OTHER, "rolled")) is not None


async def test_a_squatted_msg_id_does_not_suppress_the_other_tenants_group(stack, clients, sdk):
    model = "squatted"
    hostile = await clients(HOSTILE)
    theirs = group(OTHER, model, size=2, seed=11)
    bait = group(HOSTILE, model, size=1, seed=12)
    # The id other's SDK once sent for this group: its tenant key.
    squat = {**event_headers(bait), MSG_ID: bus.tenant_msg_id(theirs)}
    other_js = (await sdk._connect()).jetstream()
    # Squatting while other publishes: the same id again and again, each acked before the next
    # (a repeat inside the window is dropped; the first after it opens a new one).
    squats: list = []
    stop = asyncio.Event()

    async def squatting():
        while not stop.is_set():
            squats.append(
                await hostile.js.publish(subjects.trajectories(HOSTILE, model), encode(bait), headers=squat)
            )

    task = asyncio.create_task(squatting())
    try:

        async def squatted():
            return any(s.duplicate for s in squats)  # the id is live in the stream's window

        await wait_for(squatted)
        (ack,) = await bus.publish_until_acked(
            other_js, [bus.prepare(subjects.trajectories(OTHER, model), theirs)]
        )
    finally:
        stop.set()
        await task
    assert not ack.duplicate

    conn = await asyncpg.connect(stack.database_url)
    try:

        async def stored():
            return await conn.fetchval(
                "SELECT count(*) FROM trajectories WHERE project = $1 AND model = $2 AND group_id = $3",
                OTHER,
                model,
                theirs.id,
            )

        assert await wait_for(stored) == len(theirs.trajectories)
        # Other's same id with a new body, published back to back with the first (well inside
        # JetStream's window): a conflict dead letter, not a silent duplicate.
        again = group(OTHER, model, size=2, seed=13)
        changed = msgspec.structs.replace(again, metadata={"changed": True})
        await bus.publish_until_acked(
            other_js, [bus.prepare(subjects.trajectories(OTHER, model), g) for g in (again, changed)]
        )
        admin = await clients("admin")

        async def conflict():
            return [
                d
                for d in await letters(admin.js)
                if (d.kind, d.project, d.original_id) == ("conflict", OTHER, again.id)
            ]

        (letter,) = await wait_for(conflict)
        assert letter.model == model
        # The squatter's own group is stored as its own, under its own project; other's holds
        # exactly what other sent.
        rows = await conn.fetch("SELECT project, model, id FROM trajectory_groups WHERE model = $1", model)
        assert {tuple(r) for r in rows} == {
            (HOSTILE, model, bait.id),
            (OTHER, model, theirs.id),
            (OTHER, model, again.id),
        }
    finally:
        await conn.close()


async def test_stream_info_lists_nothing_of_another_tenant(stack, clients, sdk):
    model = "listed"
    await bus.publish_until_acked(
        (await sdk._connect()).jetstream(),
        [bus.prepare(subjects.trajectories(OTHER, model), group(OTHER, model))],
    )
    await art.TrainableModel(name=model, project=OTHER, base_model=TINY).register(sdk)
    hostile = await clients(HOSTILE)
    listing = json.dumps({"subjects_filter": ">"}).encode()
    for stream in (
        subjects.TRAJECTORIES.name,
        subjects.TRAINING.name,
        f"KV_{subjects.MODELS_BUCKET}",
        f"KV_{subjects.REPLICAS_BUCKET}",
    ):
        info = f"$JS.API.STREAM.INFO.{stream}"
        await hostile.denied(info, hostile.nc.request(info, listing, timeout=DENIED_WAIT_S))
    await hostile.denied(
        "$JS.API.STREAM.LIST", hostile.nc.request("$JS.API.STREAM.LIST", b"{}", timeout=DENIED_WAIT_S)
    )
    # Its own records by direct get, where the key is the subject's: a body asking for another
    # message by sequence, or by another subject, does not reach other's record.
    admin = await clients("admin")
    theirs = await (await admin.js.key_value(subjects.MODELS_BUCKET)).get(subjects.model_key(OTHER, model))
    own_key = f"$JS.API.DIRECT.GET.KV_{subjects.MODELS_BUCKET}.$KV.{subjects.MODELS_BUCKET}.{HOSTILE}.{model}"
    for body in (
        {"seq": theirs.revision},
        {"last_by_subj": f"$KV.{subjects.MODELS_BUCKET}.{OTHER}.{model}"},
        {"next_by_subj": f"$KV.{subjects.MODELS_BUCKET}.{OTHER}.{model}", "seq": 1},
    ):
        reply = await hostile.nc.request(own_key, json.dumps(body).encode(), timeout=5)
        assert (
            OTHER.encode() not in reply.data and (reply.headers or {}).get("Nats-Subject", "").find(OTHER) < 0
        ), body
    # What it may ask lists stream names, the same for every tenant: no subject, model or count.
    names = json.loads((await hostile.nc.request("$JS.API.STREAM.NAMES", b"{}", timeout=5)).data)
    assert subjects.TRAJECTORIES.name in names["streams"]
    assert OTHER not in json.dumps(names) and model not in json.dumps(names)


async def test_an_agent_creates_no_consumer_and_rewrites_none_by_name(stack, clients, sdk):
    hostile = await clients(HOSTILE)
    replicas = f"KV_{subjects.REPLICAS_BUCKET}"
    # A consumer that never expires (no inactive_threshold), in its own project's keys: the
    # kind an agent could once create by the hundred.
    keep = ConsumerConfig(
        name="kept_forever",
        filter_subject=subjects.kv_updates(subjects.REPLICAS_BUCKET, f"{HOSTILE}.>"),
        deliver_subject=hostile.nc.new_inbox(),
        deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
        ack_policy=AckPolicy.NONE,
    )
    await hostile.denied(
        f"$JS.API.CONSUMER.CREATE.{replicas}.kept_forever", hostile.js.add_consumer(replicas, keep)
    )
    # A consumer another agent (or a service) reads through, named: rewriting it to deliver
    # elsewhere is refused, on every stream.
    for stream, name in (
        (replicas, "read_0123456789abcdef"),
        (subjects.TRAJECTORIES.name, subjects.COLLECTOR_CONSUMER),
        (subjects.TRAINING.name, "trainer"),
    ):
        hijack = ConsumerConfig(name=name, deliver_subject=hostile.nc.new_inbox(), ack_policy=AckPolicy.NONE)
        await hostile.denied(f"$JS.API.CONSUMER.CREATE.{stream}", hostile.js.add_consumer(stream, hijack))
    admin = await clients("admin")
    created = [c.name for c in await admin.js.consumers_info(replicas)]
    assert "kept_forever" not in created and "read_0123456789abcdef" not in created
    # What the SDK needs is done on the agent's behalf: its replicas, listed by the publisher.
    model = art.TrainableModel(name="consumed", project=OTHER, base_model=TINY)
    await model.register(sdk)
    assert await sdk.replicas(model) == []


def _adapter(path, base: str):
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "base_model_name_or_path": base})
    )
    (path / "adapter_model.safetensors").write_bytes(b"")
    return path


def test_warm_starts_come_from_the_projects_own_adapters_only(tmp_path):
    root = tmp_path / "warm"
    mine = _adapter(root / OTHER / "sft", TINY)
    theirs = _adapter(root / HOSTILE / "sft", TINY)
    elsewhere = _adapter(tmp_path / "elsewhere", TINY)
    unlisted = _adapter(root / OTHER / "big", "some/other-model")
    (root / OTHER / "link").symlink_to(theirs)
    policy = BaseModelPolicy.parse(None, str(root), authenticated=True)
    assert policy.names == EMBEDDED
    assert policy.check(OTHER, TINY) == TINY
    assert policy.check(OTHER, str(mine)) == str(mine.resolve())
    for refused in (
        theirs,  # another project's adapter
        root / OTHER / "link",  # a link out of the project's directory
        root / OTHER / ".." / HOSTILE / "sft",  # climbing out of it
        root / OTHER,  # the directory itself
        elsewhere,  # an adapter anywhere else
        unlisted,  # its own adapter, on a base the operator does not list
        Path("/etc/shadow"),
    ):
        with pytest.raises(InvalidMessage) as caught:
            policy.check(OTHER, str(refused))
        assert caught.value.kind == "base_model", refused
    with pytest.raises(InvalidMessage, match="not a base model of this cluster"):
        policy.check(OTHER, "Qwen/Qwen2.5-1.5B-Instruct")
    # Listed by the operator; and on a bus without authentication, anything (as before).
    listed = BaseModelPolicy.parse("Qwen/Qwen2.5-1.5B-Instruct", None, authenticated=True)
    assert listed.check(OTHER, "Qwen/Qwen2.5-1.5B-Instruct") == "Qwen/Qwen2.5-1.5B-Instruct"
    assert BaseModelPolicy.parse(None, None, authenticated=False).check(OTHER, "/any/dir") == "/any/dir"
