"""Contract tests: every event round-trips in both encodings, validates against its committed JSON
Schema, and the committed documents are what the code generates (so ``make test`` fails on drift).

Pure tests: no servers.
"""

from __future__ import annotations

import datetime as dt
import inspect
import json
import re
from typing import Any, Union

import msgspec
import pytest
from jsonschema import Draft202012Validator

from artery.schemas import (
    CheckpointDeleted,
    CheckpointPublished,
    CheckpointSaved,
    CheckpointStaged,
    DeadLetter,
    Event,
    FunctionCall,
    FunctionDefinition,
    GroupReady,
    GroupScored,
    History,
    ImagePart,
    ImageURL,
    JudgeUsage,
    Message,
    ModelRecord,
    ModelRegistered,
    ModelRegistrationRequested,
    PauseAck,
    PauseInference,
    ReplicaInfo,
    ReplicasListed,
    ReplicasRequested,
    ResumeAck,
    ResumeInference,
    RetentionApplied,
    RetentionRequested,
    RewardSpec,
    RulerSpec,
    Sample,
    TextPart,
    Tool,
    ToolCall,
    TopLogprob,
    TrainCompleted,
    TrainConfig,
    TrainFailed,
    TrainRequested,
    TrainSFTConfig,
    TrainSFTRequested,
    Trajectory,
    TrajectoryException,
    TrajectoryGroupSubmitted,
    TrajectoryScore,
    generate,
)
from artery.shared import bus, subjects
from artery.shared.codec import JSON, MSGPACK, EventDecoder, encode
from artery.shared.errors import InvalidMessage

T0 = dt.datetime(2025, 1, 2, 3, 4, 5, 123000, tzinfo=dt.UTC)
EVENT_ID = "01a204a2-8123-75ac-b575-24d0861892f0"
ENVELOPE: dict[str, Any] = {
    "id": EVENT_ID,
    "project": "demo",
    "model": "agent-1",
    "step": 3,
    "time": T0,
}


def trajectory() -> Trajectory:
    """A multimodal, tool-using rollout: every nested type of the trajectory family appears."""
    image = ImagePart(image_url=ImageURL(url="data:image/png;base64,iVBORw0KGgo=", detail="low"))
    return Trajectory(
        messages=[
            Message(role="system", content="You are terse."),
            Message(role="user", content=[TextPart(text="What is in the picture?"), image]),
            Message(
                role="assistant",
                tool_calls=[ToolCall(id="call_1", function=FunctionCall(name="zoom", arguments='{"x": 2}'))],
                sample=Sample(
                    token_ids=[11, 12, 13],
                    logprobs=[-0.125, -0.5, -1.0],
                    top_logprobs=[[TopLogprob(token="z", logprob=-0.125, token_id=11)], [], []],
                    finish_reason="tool_calls",
                    served_model="agent-1@3",
                ),
            ),
            Message(role="tool", tool_call_id="call_1", name="zoom", content="a cat on a mat"),
            Message(
                role="assistant",
                content="A cat.",
                reasoning_content="Whiskers, so a cat.",
                sample=Sample(token_ids=[14], logprobs=[-0.25], finish_reason="stop"),
                trainable=True,
            ),
        ],
        tools=[
            Tool(
                function=FunctionDefinition(
                    name="zoom",
                    description="Zoom into the image.",
                    parameters={"type": "object", "properties": {"x": {"type": "number"}}},
                    strict=True,
                )
            )
        ],
        additional_histories=[History(messages=[Message(role="user", content="sub-task")])],
        reward=0.75,
        initial_policy_version=2,
        final_policy_version=3,
        metrics={"turns": 2, "solved": True, "latency_s": 1.5},
        metadata={"task": "vision-1", "seed": 7, "hard": False, "note": None},
        logs=["zoomed once"],
    )


# One realistic instance of every event; test_examples_cover_every_event keeps it complete.
EXAMPLES: list[Event] = [
    TrajectoryGroupSubmitted(
        **ENVELOPE,
        trajectories=[trajectory(), Trajectory(messages=[Message(role="user", content="hi")])],
        exceptions=[TrajectoryException(type="TimeoutError", message="timed out", traceback="Traceback…")],
        metadata={"batch": 1},
        metrics={"exceptions": 1},
        logs=["group of 2"],
        split="val",
        reward=RewardSpec(ruler=RulerSpec(judge_model="judge", rubric="be right", combine_with_reward=True)),
    ),
    GroupReady(
        **ENVELOPE, group_id="g-1", num_trajectories=2, rewards=[0.75, 0.0], needs_reward=True, stream_seq=42
    ),
    GroupScored(
        **ENVELOPE,
        group_id="g-1",
        scores=[
            TrajectoryScore(
                index=0, score=1.0, explanation="right", judge_score=1.0, independent_reward=0.75
            ),
            TrajectoryScore(index=1, score=0.0),
        ],
        judge_model="judge",
        usage=JudgeUsage(attempts=2, prompt_tokens=812, completion_tokens=64, cost_usd=0.0012),
    ),
    TrainRequested(
        **ENVELOPE,
        group_ids=["g-1", "g-2"],
        config=TrainConfig(learning_rate=1e-5, loss_fn="grpo", grad_accumulation_sequences=4),
        max_steps_off_policy=1,
    ),
    TrainSFTRequested(
        **ENVELOPE, group_ids=["g-1"], config=TrainSFTConfig(learning_rate=[2e-5, 1e-5], batch_size=4)
    ),
    TrainCompleted(**ENVELOPE, request_id="r-1", metrics={"loss": 0.125}, checkpoint="agent-1@4"),
    TrainFailed(**ENVELOPE, request_id="r-1", error="no trainable groups", retriable=False),
    CheckpointSaved(
        **ENVELOPE, uri="file:///ckpt/4", sha256="0" * 64, size_bytes=1024, base_model="Qwen/Qwen3-0.6B"
    ),
    CheckpointStaged(
        **ENVELOPE,
        uri="nats-object://artery_trainer_state/demo.agent-1/000004/adapter.tar",
        sha256="0" * 64,
        size_bytes=1024,
        base_model="Qwen/Qwen3-0.6B",
    ),
    CheckpointPublished(
        **ENVELOPE,
        object_name="demo/agent-1/4",
        sha256="a" * 64,
        size_bytes=1024,
        base_model="Qwen/Qwen3-0.6B",
        served_name="agent-1@4",
    ),
    CheckpointDeleted(**ENVELOPE, object_name="demo/agent-1/1"),
    RetentionRequested(**ENVELOPE, keep_latest=2, best_metric="val/reward", best_mode="max"),
    RetentionApplied(**ENVELOPE, kept=[2, 3], deleted=[1], best_step=2),
    ModelRegistrationRequested(
        **ENVELOPE, record=ModelRecord(project="demo", name="agent-1", base_model="artery/tiny-random")
    ),
    ModelRegistered(**ENVELOPE, error="base_model: '/etc' is not a base model of this cluster"),
    ReplicasRequested(**ENVELOPE),
    ReplicasListed(**ENVELOPE, replicas=[]),
    PauseInference(**ENVELOPE, lease_id="lease-1", lease_seconds=30.0, requested_by="trainer-0"),
    ResumeInference(**ENVELOPE, lease_id="lease-1", requested_by="trainer-0"),
    PauseAck(
        **ENVELOPE,
        replica_id="vllm-0",
        lease_id="lease-1",
        paused=True,
        lease_expires_at=T0 + dt.timedelta(seconds=30),
        drained_requests=2,
        freed_memory=True,
    ),
    ResumeAck(**ENVELOPE, replica_id="vllm-0", lease_id="lease-1", resumed=True),
    DeadLetter(
        id=EVENT_ID,
        project="_unknown",
        model="_unknown",
        time=T0,
        service="collector",
        reason="not valid JSON",
        kind="decode",
        subject="artery.traj.demo.agent-1",
        stream="ARTERY_TRAJECTORIES",
        stream_seq=7,
        original_id="abc",
        headers={"Content-Type": JSON},
        content_type=JSON,
        payload=b"\x00{not json",
    ),
]
EVENT_TYPES = generate.event_types()
ANY_EVENT = Union[tuple(EVENT_TYPES)]  # noqa: UP007 (a runtime union of a computed tuple)
CONTENT_TYPES = [JSON, MSGPACK]


def tag(event: Event) -> str:
    return generate.tag(type(event))


def schema_validator(name: str) -> Draft202012Validator:
    schema = json.loads((generate.GENERATED_DIR / "jsonschema" / f"{name}.json").read_text())
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema)


def as_json(event: Event) -> dict:
    return json.loads(encode(event, JSON))


def test_examples_cover_every_event():
    assert sorted(tag(e) for e in EXAMPLES) == [generate.tag(cls) for cls in EVENT_TYPES]


# -- round trips ---------------------------------------------------------------------------------


@pytest.mark.parametrize("content_type", CONTENT_TYPES)
@pytest.mark.parametrize("event", EXAMPLES, ids=tag)
def test_round_trip(event, content_type):
    decoded = EventDecoder(type(event)).decode(encode(event, content_type), content_type)
    assert decoded == event


@pytest.mark.parametrize("content_type", CONTENT_TYPES)
def test_union_decoder_dispatches_on_tag(content_type):
    decoder = EventDecoder(ANY_EVENT)
    for event in EXAMPLES:
        decoded = decoder.decode(encode(event, content_type), content_type)
        assert type(decoded) is type(event)
        assert decoded == event


@pytest.mark.parametrize("content_type", CONTENT_TYPES)
def test_unknown_fields_are_ignored(content_type):
    """Forward compatibility: a newer publisher's extra fields never break an older consumer."""
    event = EXAMPLES[0]
    doc = as_json(event)
    doc["added_in_v2"] = {"anything": [1, 2]}
    doc["trajectories"][0]["messages"][0]["audio"] = None
    doc["trajectories"][0]["messages"][2]["sample"]["new_stat"] = 0.5
    data = msgspec.json.encode(doc) if content_type == JSON else msgspec.msgpack.encode(doc)
    assert EventDecoder(ANY_EVENT).decode(data, content_type) == event
    assert schema_validator(tag(event)).is_valid(doc)  # the schemas are open too


# -- JSON Schema ---------------------------------------------------------------------------------


@pytest.mark.parametrize("event", EXAMPLES, ids=tag)
def test_event_validates_against_its_schema(event):
    validator = schema_validator(tag(event))
    validator.validate(as_json(event))
    # The discriminator is part of the contract: a publisher must send it.
    assert "event" in validator.schema["$defs"][type(event).__name__]["required"]


def test_replica_info_validates_against_its_schema():
    info = ReplicaInfo(
        replica_id="vllm-0",
        project="demo",
        model="agent-1",
        engine="vllm",
        url="http://127.0.0.1:8000/v1",
        served=["agent-1@3"],
        paused=True,
        lease_id="lease-1",
        heartbeat_at=T0,
    )
    schema_validator("ReplicaInfo").validate(json.loads(encode(info)))
    assert msgspec.json.decode(encode(info), type=ReplicaInfo) == info


def test_content_parts_carry_their_type_tag():
    defs = schema_validator("trajectory_group").schema["$defs"]
    assert defs["TextPart"]["properties"]["type"] == {"enum": ["text"]}
    assert "type" in defs["ImagePart"]["required"]


def _without(doc: dict, key: str) -> dict:
    return {k: v for k, v in doc.items() if k != key}


GROUP_READY = as_json(EXAMPLES[1])
SUBMITTED = as_json(EXAMPLES[0])
INVALID = {
    "wrong type": (GroupReady, {**GROUP_READY, "num_trajectories": "two"}),
    "missing required field": (GroupReady, _without(GROUP_READY, "group_id")),
    "project name with a leading dot": (GroupReady, {**GROUP_READY, "project": ".evil"}),
    "project name that is a parent directory": (GroupReady, {**GROUP_READY, "project": ".."}),
    "empty trajectories": (TrajectoryGroupSubmitted, {**SUBMITTED, "trajectories": []}),
    "empty messages": (
        TrajectoryGroupSubmitted,
        {**SUBMITTED, "trajectories": [{**SUBMITTED["trajectories"][0], "messages": []}]},
    ),
    "unknown tag": (GroupReady, {**GROUP_READY, "event": "group.unready"}),
    "unknown content part": (
        TrajectoryGroupSubmitted,
        {**SUBMITTED, "trajectories": [{"messages": [{"role": "user", "content": [{"type": "audio"}]}]}]},
    ),
}


@pytest.mark.parametrize("content_type", CONTENT_TYPES)
@pytest.mark.parametrize("case", INVALID)
def test_invalid_documents_are_rejected_by_both(case, content_type):
    cls, doc = INVALID[case]
    data = msgspec.json.encode(doc) if content_type == JSON else msgspec.msgpack.encode(doc)
    for decoder in (EventDecoder(cls), EventDecoder(ANY_EVENT)):
        with pytest.raises(InvalidMessage):
            decoder.decode(data, content_type)
    assert not schema_validator(generate.tag(cls)).is_valid(doc)


# -- generated documents -------------------------------------------------------------------------


def test_committed_documents_match_the_code():
    problems = generate.check()
    assert problems == [], "run `make schemas` and commit:\n" + "\n".join(problems)


def test_drift_is_detected(tmp_path):
    generate.write(tmp_path)
    assert generate.check(tmp_path) == []
    ready = tmp_path / "jsonschema" / "group.ready.json"
    ready.write_text(ready.read_text().replace('"minimum": 1', '"minimum": 2'))
    (tmp_path / "jsonschema" / "dead_letter.json").unlink()
    (tmp_path / "jsonschema" / "retired.event.json").write_text("{}\n")
    assert generate.check(tmp_path) == [
        "missing: jsonschema/dead_letter.json",
        "drifted: jsonschema/group.ready.json",
        "extra (no type generates it): jsonschema/retired.event.json",
    ]
    assert generate.main(["--check", "--out", str(tmp_path)]) == 1
    generate.write(tmp_path)  # regenerating repairs all three
    assert generate.main(["--check", "--out", str(tmp_path)]) == 0


# -- AsyncAPI ------------------------------------------------------------------------------------

ASYNCAPI = json.loads((generate.GENERATED_DIR / "asyncapi.json").read_text())
# Functions of shared/subjects.py that name KV keys or parse subjects; every other one is a subject
# and must have a channel.
#: KV keys and their update subjects are not event channels (the KV values are in the contract).
NOT_SUBJECT_FUNCTIONS = {
    "model_key",
    "replica_key",
    "replica_keys",
    "kv_updates",
    "parse_trajectories",
    "covers",  # subject matching, not a subject
    # names as tokens: the escape of a dot, and keys read back into names
    "token",
    "name_of",
    "_pm",
    "project_keys",
    "names_of_key",
}
SUBJECT_FUNCTIONS = [
    fn
    for name, fn in inspect.getmembers(subjects, inspect.isfunction)
    if fn.__module__ == subjects.__name__ and name not in NOT_SUBJECT_FUNCTIONS
]


def subject_pattern(fn) -> re.Pattern:
    """The channel address a subject function must appear as, e.g. ``artery.traj.{project}.{model}``;
    arguments that pick among subjects (``kind``, ``action``) match any token."""
    names = list(inspect.signature(fn).parameters)
    pattern = re.escape(fn(*(f"{{{n}}}" for n in names)))
    for name in set(names) - set(generate.PARAMETERS):
        pattern = pattern.replace(re.escape(f"{{{name}}}"), r"[a-z_]+")
    return re.compile(pattern + "$")


def test_asyncapi_version_and_info():
    assert ASYNCAPI["asyncapi"] == "3.0.0"
    assert "new field always gets a default" in ASYNCAPI["info"]["description"]


@pytest.mark.parametrize("fn", SUBJECT_FUNCTIONS, ids=lambda fn: fn.__name__)
def test_every_subject_function_has_a_channel(fn):
    addresses = [c["address"] for c in ASYNCAPI["channels"].values() if c["address"]]
    assert any(subject_pattern(fn).match(a) for a in addresses), addresses


def test_channels_name_the_stream_that_holds_them():
    streams = {spec.name: spec for spec in subjects.STREAMS}
    for channel_id, channel in ASYNCAPI["channels"].items():
        if channel["address"] is None:  # a reply inbox
            continue
        holders = [
            name
            for name, spec in streams.items()
            if any(subjects.covers(f, channel["address"]) for f in spec.subjects)
        ]
        expected = holders[0] if holders else "none (request/reply)"
        assert len(holders) <= 1, channel_id
        assert channel["x-jetstream-stream"] == expected, channel_id
        assert expected in channel["description"]


def test_every_event_has_a_message_and_a_channel():
    on_channels = {ref["$ref"] for c in ASYNCAPI["channels"].values() for ref in c["messages"].values()}
    for cls in EVENT_TYPES:
        assert ASYNCAPI["components"]["messages"][cls.__name__]["name"] == generate.tag(cls)
        assert f"#/components/messages/{cls.__name__}" in on_channels


def test_every_ref_resolves():
    refs = []

    def walk(node):
        if isinstance(node, dict):
            refs.extend(v for k, v in node.items() if k == "$ref")
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(ASYNCAPI)
    assert refs
    for ref in refs:
        assert ref.startswith("#/"), ref
        node = ASYNCAPI
        for part in ref[2:].split("/"):
            node = node[part.replace("~1", "/").replace("~0", "~")]


def _asyncapi_validator(schema_name: str) -> Draft202012Validator:
    # The component refs are absolute within the document, so the components ride along.
    schema = {"$ref": f"#/components/schemas/{schema_name}", "components": ASYNCAPI["components"]}
    return Draft202012Validator(schema)


@pytest.mark.parametrize("event", EXAMPLES, ids=tag)
def test_asyncapi_payloads_and_headers_accept_real_messages(event):
    _asyncapi_validator(type(event).__name__).validate(as_json(event))
    headers = bus.event_headers(event, MSGPACK)
    headers["traceparent"] = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    _asyncapi_validator(generate.HEADERS_SCHEMA).validate(headers)
    header_names = set(ASYNCAPI["components"]["schemas"][generate.HEADERS_SCHEMA]["properties"])
    assert set(headers) <= header_names
    assert {bus.MSG_ID, bus.CONTENT_TYPE, bus.SCHEMA_HEADER, bus.EVENT_HEADER, "tracestate"} <= header_names


def test_event_id_is_required_so_redeliveries_keep_their_identity():
    document = {"event": "group.ready", **{k: v for k, v in ENVELOPE.items() if k != "id"}}
    document.update(group_id="g-1", num_trajectories=1, rewards=[1.0])
    document["time"] = T0.isoformat()
    with pytest.raises(InvalidMessage, match="id"):
        EventDecoder(GroupReady).decode(msgspec.json.encode(document))


def test_timestamps_without_a_time_zone_are_rejected():
    document = {"event": "group.ready", **ENVELOPE, "group_id": "g", "num_trajectories": 1, "rewards": [0.0]}
    document["time"] = "2025-01-01T00:00:00"
    with pytest.raises(InvalidMessage, match="time"):
        EventDecoder(GroupReady).decode(msgspec.json.encode(document))
