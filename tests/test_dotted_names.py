"""Project and model names with a dot, as ART allows (``Qwen2.5-7b-agent``, ``v1.2``).

A dot separates NATS subject tokens and KV key tokens, so every name becomes one token through
``subjects.token`` (``.`` -> ``=2E``): project ``a.b`` must never read as project ``a``, model
``b``, nor reach their data. Names that are path-traversal bait (``.``, ``..``, a leading or
trailing dot) are refused.
"""

from __future__ import annotations

import contextlib

import asyncpg
import msgspec
import pytest

import artery as art
from artery.ops.stack import Stack
from artery.schemas import GroupReady, ModelRecord
from artery.shared import bus, subjects
from artery.shared.bus import tenant_msg_id
from artery.shared.codec import EventDecoder, encode
from artery.shared.errors import InvalidMessage
from artery.shared.models import TINY
from artery.shared.permissions import inbox_prefix, permissions
from artery.shared.registry import models_kv, read_record, register
from artery.shared.served_name import parse_served_name, served_name
from artery.testing.agents import half_alphabet_rollout
from tests.factories import group
from tests.helpers import wait_for
from tests.test_secure_stack import _password, connect, violations
from tests.test_security import Client

DOTTED, PREFIX_PROJECT = "a.b", "a"


@pytest.mark.parametrize("name", ["agent-1.5", "Qwen2.5-7b-agent", "v1.2", "a..b", "x.y.z"])
def test_a_dotted_name_is_one_token_everywhere_and_reads_back(name):
    assert subjects.name_of(subjects.token(name)) == name
    for build in (
        subjects.trajectories,
        lambda p, m: subjects.train("requested", p, m),
        lambda p, m: subjects.checkpoint("published", p, m),
        lambda p, m: subjects.control("pause", p, m),
        subjects.register_request,
        subjects.model_key,
    ):
        dotted, plain = build(name, name), build("p", "m")
        assert dotted.count(".") == plain.count("."), dotted  # the same tokens, none split
    assert subjects.parse_trajectories(subjects.trajectories(name, "m")) == (name, "m")
    assert subjects.names_of_key(subjects.model_key(name, name)) == (name, name)
    assert parse_served_name(served_name(name, 12)) == (name, 12)


def test_names_without_a_dot_keep_their_subjects():
    assert subjects.trajectories("demo", "agent") == "artery.traj.demo.agent"
    assert subjects.model_key("demo", "agent") == "demo.agent"
    assert inbox_prefix("agent-demo") == "_INBOX.agent-demo"


@pytest.mark.parametrize("name", [".", "..", ".hidden", "trailing.", "a/b", "a b", "a=2Eb", "*", ""])
def test_traversal_bait_and_non_names_are_refused_with_the_reason(name):
    with pytest.raises(ValueError, match=r"is not a valid name: "):
        art.TrainableModel(name=name, project="p", base_model=TINY)
    with pytest.raises(ValueError, match=r"project .* is not a valid name"):
        art.TrainableModel(name="m", project=name, base_model=TINY)
    ready = GroupReady(id="g", project="p", model="m", group_id="g", num_trajectories=1, rewards=[1.0])
    document = {**msgspec.json.decode(encode(ready)), "project": name}
    with pytest.raises(InvalidMessage):  # and on the wire, whatever wrote the event
        EventDecoder(GroupReady).decode(msgspec.json.encode(document))


def test_a_dot_error_says_why():
    with pytest.raises(ValueError, match="may not start or end with a dot"):
        art.TrainableModel(name="..", project="p", base_model=TINY)


def _tenant_subjects(project: str, model: str) -> list[str]:
    return [
        subjects.trajectories(project, model),
        subjects.train("requested", project, model),
        subjects.train("completed", project, model),
        subjects.register_request(project, model),
        subjects.replicas_request(project, model),
        subjects.retention_request(project, model),
        f"$JS.API.DIRECT.GET.KV_{subjects.MODELS_BUCKET}."
        + subjects.kv_updates(subjects.MODELS_BUCKET, subjects.model_key(project, model)),
        subjects.kv_updates(subjects.REPLICAS_BUCKET, subjects.replica_key(project, model, "r1")),
        inbox_prefix(f"agent-{project}") + ".reply",
    ]


@pytest.mark.parametrize(
    ("holder", "victim"),
    [(DOTTED, PREFIX_PROJECT), (DOTTED, "b"), (PREFIX_PROJECT, DOTTED), ("a.b.c", DOTTED), (DOTTED, "a.b.c")],
)
def test_an_agents_permissions_reach_no_subject_of_a_project_its_name_overlaps(holder, victim):
    rights = permissions("agent", f"agent-{holder}", project=holder)
    allowed = [*rights.publish, *rights.subscribe]
    for model in ("b", "m", "b.c", "m.1"):
        for subject in _tenant_subjects(victim, model):
            reached = [p for p in allowed if subjects.covers(p, subject)]
            assert reached == [] or set(reached) <= {"$JS.API.STREAM.NAMES"}, (subject, reached)
        # ... while its own are reached (the same check is not vacuous).
        for subject in _tenant_subjects(holder, model)[:6]:
            assert any(subjects.covers(p, subject) for p in rights.publish + rights.subscribe), subject


def test_message_ids_of_overlapping_tenants_differ():
    """Project ``a.b``, model ``c`` and project ``a``, model ``b.c`` share no de-duplication id."""
    one = group(DOTTED, "c")
    other = msgspec.structs.replace(group(PREFIX_PROJECT, "b.c"), id=one.id)
    assert tenant_msg_id(one) != tenant_msg_id(other)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    home = tmp_path_factory.mktemp("dotted") / "stack"
    s = Stack(home=home, secure=True, projects=(DOTTED, PREFIX_PROJECT), services=("collector", "publisher"))
    s.start()
    try:
        yield s
    finally:
        s.stop()


async def test_project_a_dot_b_cannot_reach_project_a_on_a_real_server(stack):
    clients: list[Client] = []
    try:
        dotted = await connect(stack, stack.agent_env(DOTTED))
        plain = await connect(stack, stack.agent_env(PREFIX_PROJECT))
        admin = await connect(stack, {"ARTERY_NATS_USER": "admin", **_password(stack, "admin")})
        clients += [dotted, plain, admin]
        # Its own group is stored, under its own project's name.
        own = group(DOTTED, "m.1")
        await bus.publish_event(dotted.js, subjects.trajectories(DOTTED, "m.1"), own)
        conn = await asyncpg.connect(stack.database_url)
        try:

            async def stored() -> bool:
                sql = "SELECT DISTINCT project, model FROM trajectories WHERE group_id = $1"
                rows = await conn.fetch(sql, own.id)
                return [tuple(r) for r in rows] == [(DOTTED, "m.1")]

            assert await wait_for(stored) is True
        finally:
            await conn.close()
        # Registering its own dotted model works through the publisher; the record's key is escaped.
        await register(dotted.js, ModelRecord(project=DOTTED, name="m.1", base_model=TINY, trainable=True))
        found = await read_record(models_kv(dotted.js), DOTTED, "m.1")
        assert found is not None and (found.record.project, found.record.name) == (DOTTED, "m.1")
        models = await admin.js.key_value(subjects.MODELS_BUCKET)
        assert subjects.model_key(DOTTED, "m.1") in await models.keys()
        dotted.clean()
        # The unescaped reading of "a.b" + model "m" is project "a", model "b"...: all refused.
        target = "artery.traj.a.b"
        await dotted.denied(target, bus.publish_event(dotted.js, target, group(PREFIX_PROJECT, "b")))
        register_a = subjects.register_request(PREFIX_PROJECT, "b")
        await dotted.denied(register_a, dotted.nc.request(register_a, b"{}", timeout=1))
        # ... and project "a" cannot reach "a.b" either.
        into_dotted = subjects.trajectories(DOTTED, "m.1")
        await plain.denied(into_dotted, bus.publish_event(plain.js, into_dotted, group(DOTTED, "m.1")))
        record_get = f"$JS.API.DIRECT.GET.KV_{subjects.MODELS_BUCKET}.$KV.{subjects.MODELS_BUCKET}.a=2Eb"
        await plain.denied(record_get, read_record(models_kv(plain.js), DOTTED, "m.1"))
        assert all(p.running for p in stack.processes.values())
        assert violations(stack) == []
    finally:
        for client in clients:
            with contextlib.suppress(Exception):
                await client.nc.close()


@pytest.mark.timeout(300)
async def test_a_dotted_model_of_a_dotted_project_trains_and_is_served(tmp_path):
    """Agent -> collector -> trainer -> publisher -> inference, on a secure stack whose agent user
    is ``agent-proj.x``: a real step with tokens trained, served as ``agent-1.5@1``."""
    project, name = "proj.x", "agent-1.5"
    backend = art.LocalBackend(path=tmp_path / "art", secure=True, project=project)
    model = art.TrainableModel(name=name, project=project, base_model=TINY)
    try:
        await model.register(backend)
        groups = await art.gather_trajectory_groups(
            art.TrajectoryGroup(half_alphabet_rollout(model, max_tokens=8) for _ in range(4))
            for _ in range(2)
        )
        result = await model.train(groups, config=art.TrainConfig(learning_rate=1e-2))
        assert result.step == 1 and await model.get_step() == 1
        assert result.metrics["tokens_trained"] > 0
        (replica,) = await backend.replicas(model)
        assert served_name(name, 1) in replica.served
        completion = await model.openai_client().chat.completions.create(
            model=model.get_inference_name(1), messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert completion.model == f"{name}@1" and completion.choices[0].message is not None
        assert violations(backend.stack) == []
    finally:
        await backend.close()
