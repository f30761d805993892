"""The AsyncAPI 3.0.0 document of the wire contract (dev time): servers, every channel (subject,
stream, who publishes and who consumes), operations, payloads and headers, the buckets beside
the streams. Addresses come from ``shared.subjects``'s functions, header names from
``shared.bus``, payloads from ``json_schemas``: the document cannot say what the code does not do.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import msgspec

import artery.schemas as package
from artery.schemas import (
    SCHEMA_VERSION,
    CheckpointDeleted,
    CheckpointPublished,
    CheckpointSaved,
    CheckpointStaged,
    DeadLetter,
    Event,
    GroupReady,
    GroupScored,
    ModelRegistered,
    ModelRegistrationRequested,
    PauseAck,
    PauseInference,
    ReplicasListed,
    ReplicasRequested,
    ResumeAck,
    ResumeInference,
    RetentionApplied,
    RetentionRequested,
    TrainCompleted,
    TrainFailed,
    TrainRequested,
    TrainSFTRequested,
    TrajectoryGroupSubmitted,
)
from artery.schemas.base import NAME_PATTERN
from artery.schemas.json_schemas import KV_VALUES, event_types, summary, tag, tidy
from artery.shared import bus, subjects
from artery.shared.codec import CONTENT_TYPES, JSON
from artery.shared.settings import CommonSettings

HEADERS_SCHEMA = "ArteryHeaders"
# Placeholders in channel addresses; AsyncAPI fills them from the channel's parameters.
PROJECT, MODEL, SERVICE = "{project}", "{model}", "{service}"


@dataclass(frozen=True)
class Channel:
    id: str
    #: The subject with ``{parameters}``; None for a requester's reply inbox (chosen per request).
    address: str | None
    stream: subjects.StreamSpec | None
    message: type[Event]
    publishers: str
    consumers: str
    #: For request/reply: the id of the channel the answer comes back on.
    reply: str | None = None
    #: Other events on the same subject (a tagged union with ``message``), told apart by ``event``.
    also: tuple[type[Event], ...] = ()

    @property
    def messages(self) -> tuple[type[Event], ...]:
        return (self.message, *self.also)


def channels() -> list[Channel]:
    """Every channel, with addresses produced by the subject functions themselves."""
    s, p, m = subjects, PROJECT, MODEL
    # A table, one channel per row, is easier to review than the formatter's layout.
    # fmt: off
    return [
        Channel("trajectories", s.trajectories(p, m), s.TRAJECTORIES, TrajectoryGroupSubmitted,
                "agents (the SDK, or any NATS client)", "the collector"),
        Channel("groupReady", s.group_ready(p, m), s.GROUPS, GroupReady,
                "the collector", "the reward service and the trainer"),
        Channel("groupScored", s.group_scored(p, m), s.GROUPS, GroupScored,
                "the reward service", "the trainer"),
        Channel("trainRequested", s.train("requested", p, m), s.TRAINING, TrainRequested,
                "the SDK", "the trainer", also=(TrainSFTRequested,)),
        Channel("trainCompleted", s.train("completed", p, m), s.TRAINING, TrainCompleted,
                "the trainer", "the SDK"),
        Channel("trainFailed", s.train("failed", p, m), s.TRAINING, TrainFailed, "the trainer", "the SDK"),
        Channel("checkpointSaved", s.checkpoint("saved", p, m), s.CHECKPOINTS, CheckpointSaved,
                "the trainer", "the publisher"),
        Channel("checkpointStaged", s.checkpoint_staged(p, m), None, CheckpointStaged,
                "the trainer", "inference replicas"),
        Channel("checkpointPublished", s.checkpoint("published", p, m), s.CHECKPOINTS, CheckpointPublished,
                "the publisher", "inference replicas"),
        Channel("checkpointDeleted", s.checkpoint("deleted", p, m), s.CHECKPOINTS, CheckpointDeleted,
                "the publisher", "inference replicas"),
        Channel("controlPause", s.control("pause", p, m), None, PauseInference,
                "the trainer", "inference replicas", reply="controlPauseReply"),
        Channel("controlPauseReply", None, None, PauseAck, "inference replicas", "the trainer"),
        Channel("controlResume", s.control("resume", p, m), None, ResumeInference,
                "the trainer", "inference replicas", reply="controlResumeReply"),
        Channel("controlResumeReply", None, None, ResumeAck, "inference replicas", "the trainer"),
        Channel("retentionRequest", s.retention_request(p, m), None, RetentionRequested,
                "the SDK (model.delete_checkpoints)", "the publisher", reply="retentionReply"),
        Channel("retentionReply", None, None, RetentionApplied, "the publisher", "the SDK"),
        Channel("registerRequest", s.register_request(p, m), None, ModelRegistrationRequested,
                "the SDK (model.register)", "the publisher", reply="registerReply"),
        Channel("registerReply", None, None, ModelRegistered, "the publisher", "the SDK"),
        Channel("replicasRequest", s.replicas_request(p, m), None, ReplicasRequested,
                "the SDK (finding a replica)", "the publisher", reply="replicasReply"),
        Channel("replicasReply", None, None, ReplicasListed, "the publisher", "the SDK"),
        Channel("deadLetters", s.dead_letter(SERVICE), s.DLQ, DeadLetter,
                "any service that rejects input", "operators (kept for inspection and replay)"),
    ]
    # fmt: on


PARAMETERS = {
    "project": f"Project name matching `{NAME_PATTERN}`, as one token: each `.` written `=2E`.",
    "model": f"Model name matching `{NAME_PATTERN}`, as one token: each `.` written `=2E`.",
    "service": "The service that rejected the input (e.g. `collector`).",
}


def headers_schema() -> dict:
    window_min = bus.DUPLICATE_WINDOW_S / 60
    agent_window_ms = bus.AGENT_DUPLICATE_WINDOW_S * 1000
    return {
        "type": "object",
        "description": "NATS headers, the same on every message. Unknown headers are ignored.",
        "properties": {
            bus.MSG_ID: {
                "type": "string",
                "description": "`<project>.<model>.<id>`: the event's id within its tenant. JetStream "
                f"drops a re-publish with the same id within the stream's duplicate window: "
                f"{window_min:g} minutes, or {agent_window_ms:g} ms (its minimum) on the streams agents "
                "write to, where one window is shared by every tenant. There the consumers are "
                "idempotent on (project, model, id) themselves.",
            },
            bus.CONTENT_TYPE: {
                "type": "string",
                "enum": list(CONTENT_TYPES),
                "default": JSON,
                "description": "Encoding of the payload; a message without it is JSON.",
            },
            bus.SCHEMA_HEADER: {
                "type": "string",
                "const": SCHEMA_VERSION,
                "description": "Version of the set of event tags (`artery.schemas.SCHEMA_VERSION`).",
            },
            bus.EVENT_HEADER: {
                "type": "string",
                "description": "The event tag: the same as the payload's `event` field.",
            },
            "traceparent": {"type": "string", "description": "W3C trace context: the parent span."},
            "tracestate": {"type": "string", "description": "W3C trace context: vendor state."},
        },
    }


def info_description() -> str:
    # The evolution rules are written once, in the package docstring; quote them from there.
    paragraphs = inspect.cleandoc(package.__doc__ or "").split("\n\n")
    rules = next(p for p in paragraphs if p.startswith("Evolution rules"))
    return "\n\n".join(
        [
            "Artery's wire contract: every NATS subject, JetStream stream, payload and header of the "
            "services. Payloads are JSON by default, msgpack when `Content-Type` says so. Every event "
            "carries its type in the `event` field (a tagged union); content parts carry `type`.",
            f"Project and model names match `{NAME_PATTERN}` (no wildcards or whitespace; a dot "
            "inside, never first or last). In a subject or a KV key each name is one token, its "
            "dots written `=2E` (project `a.b` is the token `a=2Eb`), since a dot separates tokens.",
            "Consumers ignore fields they do not know, so a newer publisher stays readable.",
            rules,
        ]
    )


def _asyncapi_schema(node: Any) -> Any:
    """AsyncAPI's Schema Object takes ``discriminator`` as the property name alone, where
    msgspec writes OpenAPI's ``{"propertyName": ..., "mapping": ...}``."""
    if isinstance(node, dict):
        return {
            k: v["propertyName"] if k == "discriminator" and isinstance(v, dict) else _asyncapi_schema(v)
            for k, v in node.items()
        }
    if isinstance(node, list):
        return [_asyncapi_schema(v) for v in node]
    return node


def _ref(*parts: str) -> dict:
    return {"$ref": "#/" + "/".join(parts)}


def buckets() -> dict:
    """Live state beside the streams: AsyncAPI has no word for it, hence an extension."""
    found: dict[str, dict[str, Any]] = {
        subjects.MODELS_BUCKET: {"kind": "key-value", "key": "<project>.<model>"},
        subjects.REPLICAS_BUCKET: {
            "kind": "key-value",
            "key": "<project>.<model>.<replica id>",
            "ttl_seconds": bus.REPLICA_TTL_S,
        },
        subjects.ADAPTERS_BUCKET: {"kind": "object-store", "key": "CheckpointPublished.object_name"},
    }
    for bucket, value_type in KV_VALUES.items():
        found[bucket]["value"] = _ref("components", "schemas", value_type.__name__)
    return found


def servers() -> dict:
    """Where every channel lives: one NATS server (JetStream on), or a cluster of them. Its address
    is the deployment's (``ARTERY_NATS_URL``, comma-separated for a cluster); the default is the
    services' own default."""
    default = urlsplit(CommonSettings().nats_url.split(",")[0])
    return {
        "nats": {
            "host": "{host}:{port}",
            "protocol": "nats",
            "title": "Artery's NATS server",
            "description": "A NATS server with JetStream: `artery up`'s, docker compose's `nats`, or the "
            "one a `LocalBackend` starts. Every service and agent connects to it with `ARTERY_NATS_URL`; "
            "with NATS permissions each service connects as its own user and an agent as "
            "`agent-<project>`, allowed its project's subjects only.",
            "variables": {
                "host": {"default": default.hostname, "description": "The server's host name or address."},
                "port": {"default": str(default.port), "description": "Its client port."},
            },
        }
    }


def _camel(word: str) -> str:
    return word[:1].upper() + word[1:]


def asyncapi() -> dict:
    events = event_types()
    _, components = msgspec.json.schema_components(
        [*events, *KV_VALUES.values()], ref_template="#/components/schemas/{name}"
    )
    assert HEADERS_SCHEMA not in components
    schemas = {**_asyncapi_schema(tidy(components)), HEADERS_SCHEMA: headers_schema()}
    messages = {
        cls.__name__: {
            "name": tag(cls),
            "title": cls.__name__,
            "summary": summary(cls),
            "headers": _ref("components", "schemas", HEADERS_SCHEMA),
            "payload": _ref("components", "schemas", cls.__name__),
        }
        for cls in events
    }

    all_channels = {ch.id: ch for ch in channels()}
    doc_channels: dict[str, dict] = {}
    operations: dict[str, dict] = {}
    for ch in all_channels.values():
        names = [cls.__name__ for cls in ch.messages]
        stream = ch.stream.name if ch.stream else "none (request/reply)"
        if ch.address is None:
            where = "The requester's reply inbox (`_INBOX.…`), chosen per request."
        else:
            where = f"JetStream stream: {stream}."
        doc_channels[ch.id] = {
            "address": ch.address,
            "description": f"{where} Published by {ch.publishers}; consumed by {ch.consumers}.",
            "messages": {name: _ref("components", "messages", name) for name in names},
            "x-jetstream-stream": stream,
        }
        params = re.findall(r"\{(\w+)\}", ch.address or "")
        if params:
            doc_channels[ch.id]["parameters"] = {p: {"description": PARAMETERS[p]} for p in params}
        if ch.address is None:
            continue  # a reply inbox has no operations of its own: the request's reply covers it
        for action, who in (("send", ch.publishers), ("receive", ch.consumers)):
            op = {
                "action": action,
                "channel": _ref("channels", ch.id),
                "messages": [_ref("channels", ch.id, "messages", name) for name in names],
                "summary": f"{'Published' if action == 'send' else 'Consumed'} by {who}.",
            }
            if ch.reply:
                reply = all_channels[ch.reply]
                op["reply"] = {
                    "channel": _ref("channels", reply.id),
                    "messages": [_ref("channels", reply.id, "messages", reply.message.__name__)],
                }
            operations[f"{action}{_camel(ch.id)}"] = op

    return {
        "asyncapi": "3.0.0",
        "id": "urn:artery:wire-contract",
        "info": {"title": "Artery", "version": SCHEMA_VERSION, "description": info_description()},
        "defaultContentType": JSON,
        "servers": servers(),
        "channels": doc_channels,
        "operations": operations,
        "components": {"schemas": schemas, "messages": messages},
        "x-nats-buckets": buckets(),
        "x-jetstream-streams": {
            spec.name: {
                "subjects": list(spec.subjects),
                "description": spec.description,
                "duplicate_window_seconds": bus.duplicate_window_s(spec),
            }
            for spec in subjects.STREAMS
        },
    }
