"""Write the wire-contract documents under ``generated/`` from the Structs of this package.

    python -m artery.schemas.generate           # rewrite the documents
    python -m artery.schemas.generate --check   # write nothing; exit 1 when the committed ones drift

It writes ``jsonschema/<tag>.json`` (JSON Schema 2020-12, one per event, and ``<Name>.json`` for
each KV value type) and ``asyncapi.json`` (AsyncAPI 3.0.0: every subject, stream, payload
and header). All of it is derived from code (this package, the subject functions of
``shared.subjects``, the header names of ``shared.bus``), so the documents a Go or Node publisher
reads cannot say something the services do not do. This dev-time module is the only one in
``schemas/`` that reads ``artery.shared``; nothing at run time imports it.

Output is deterministic (sorted keys, no timestamps) so that the drift check is a plain
byte comparison.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import pkgutil
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

import artery.schemas as package
from artery.schemas import (
    SCHEMA_VERSION,
    CheckpointDeleted,
    CheckpointPublished,
    CheckpointSaved,
    DeadLetter,
    Event,
    GroupReady,
    GroupScored,
    ModelRecord,
    PauseAck,
    PauseInference,
    ReplicaInfo,
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
from artery.shared import bus, subjects
from artery.shared.codec import CONTENT_TYPES, JSON

GENERATED_DIR = Path(__file__).parent / "generated"
DIALECT = "https://json-schema.org/draft/2020-12/schema"
HEADERS_SCHEMA = "ArteryHeaders"
#: The value type of each key-value bucket, by bucket; each also gets a JSON Schema file.
KV_VALUES: dict[str, type] = {subjects.REPLICAS_BUCKET: ReplicaInfo, subjects.MODELS_BUCKET: ModelRecord}
# Placeholders in channel addresses; AsyncAPI fills them from the channel's parameters.
PROJECT, MODEL, SERVICE = "{project}", "{model}", "{service}"


# ---------------------------------------------------------------------------------------------
# Finding the types


def tag(cls: type) -> str:
    return cls.__struct_config__.tag


def event_types() -> list[type[Event]]:
    """Every concrete event of this package, by tag: new events are found without edits here."""
    # Import every module first, so an event is found even before __init__ exports it.
    for module in pkgutil.iter_modules(package.__path__):
        if module.name != "generate":
            importlib.import_module(f"{package.__name__}.{module.name}")
    found: set[type[Event]] = set()
    todo = [Event]
    while todo:
        for sub in todo.pop().__subclasses__():
            todo.append(sub)
            # Only tagged classes are concrete; events defined by tests elsewhere are not ours.
            if sub.__struct_config__.tag is not None and sub.__module__.startswith(f"{package.__name__}."):
                found.add(sub)
    events = sorted(found, key=tag)
    tags = [tag(cls) for cls in events]
    if len(set(tags)) != len(tags):
        raise RuntimeError(f"two events share a tag: {tags}")
    return events


def summary(cls: type) -> str:
    """The first paragraph of the class docstring, on one line."""
    doc = inspect.cleandoc(cls.__doc__ or "")
    return " ".join(doc.split("\n\n")[0].split()) or f"The `{tag(cls)}` event."


def _tidy(node: Any) -> Any:
    """Dedent descriptions: msgspec's dedent leaves a docstring's body indented when its text
    starts on the opening line, as ours do."""
    if isinstance(node, dict):
        return {
            k: inspect.cleandoc(v) if k == "description" and isinstance(v, str) else _tidy(v)
            for k, v in node.items()
        }
    if isinstance(node, list):
        return [_tidy(v) for v in node]
    return node


# ---------------------------------------------------------------------------------------------
# JSON Schema, one file per type


def json_schema(cls: type, name: str) -> dict:
    schema = _tidy(msgspec.json.schema(cls))  # {"$ref": "#/$defs/<cls>", "$defs": {...}}
    return {
        "$schema": DIALECT,
        "$id": f"urn:artery:schema:{SCHEMA_VERSION}:{name}",
        "title": cls.__name__,
        "description": summary(cls),
        **schema,
    }


# ---------------------------------------------------------------------------------------------
# AsyncAPI


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
        Channel("deadLetters", s.dead_letter(SERVICE), s.DLQ, DeadLetter,
                "any service that rejects input", "operators (kept for inspection and replay)"),
    ]
    # fmt: on


PARAMETERS = {
    "project": f"Project name: one subject token matching `{NAME_PATTERN}`.",
    "model": f"Model name: one subject token matching `{NAME_PATTERN}`.",
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
            f"Project and model names are single subject tokens matching `{NAME_PATTERN}` "
            "(no dots, wildcards or whitespace).",
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
    found = {
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


def _camel(word: str) -> str:
    return word[:1].upper() + word[1:]


def asyncapi() -> dict:
    events = event_types()
    _, components = msgspec.json.schema_components(
        [*events, *KV_VALUES.values()], ref_template="#/components/schemas/{name}"
    )
    assert HEADERS_SCHEMA not in components
    schemas = {**_asyncapi_schema(_tidy(components)), HEADERS_SCHEMA: headers_schema()}
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


# ---------------------------------------------------------------------------------------------
# Writing and checking


def _dump(doc: dict) -> str:
    return json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def render() -> dict[str, str]:
    """Every generated file, by path relative to the output folder."""
    files = {f"jsonschema/{tag(cls)}.json": _dump(json_schema(cls, tag(cls))) for cls in event_types()}
    for value_type in KV_VALUES.values():
        files[f"jsonschema/{value_type.__name__}.json"] = _dump(json_schema(value_type, value_type.__name__))
    files["asyncapi.json"] = _dump(asyncapi())
    return files


def _existing(out_dir: Path) -> set[str]:
    """Generated-looking files on disk: the two folders this module owns, JSON only."""
    paths = [*out_dir.glob("*.json"), *out_dir.glob("jsonschema/*.json")]
    return {p.relative_to(out_dir).as_posix() for p in paths}


def check(out_dir: Path = GENERATED_DIR) -> list[str]:
    """What differs between the files in ``out_dir`` and what the code generates; empty if none."""
    expected = render()
    problems = []
    for path in sorted(expected.keys() | _existing(out_dir)):
        file = out_dir / path
        if path not in expected:
            problems.append(f"extra (no type generates it): {path}")
        elif not file.exists():
            problems.append(f"missing: {path}")
        elif file.read_text(encoding="utf-8") != expected[path]:
            problems.append(f"drifted: {path}")
    return problems


def write(out_dir: Path = GENERATED_DIR) -> list[str]:
    """Write every file and remove stale ones (a retired event); returns the paths written."""
    files = render()
    for stale in _existing(out_dir) - files.keys():
        (out_dir / stale).unlink()
    for path, text in files.items():
        (out_dir / path).parent.mkdir(parents=True, exist_ok=True)
        (out_dir / path).write_text(text, encoding="utf-8")
    return sorted(files)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m artery.schemas.generate", description=__doc__)
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 on drift")
    parser.add_argument("--out", type=Path, default=GENERATED_DIR, help="output folder")
    args = parser.parse_args(argv)
    if args.check:
        problems = check(args.out)
        if problems:
            print(f"{args.out} does not match the schema code:", file=sys.stderr)
            for problem in problems:
                print(f"  {problem}", file=sys.stderr)
            print("Run `make schemas` (python -m artery.schemas.generate) and commit.", file=sys.stderr)
            return 1
        print(f"{args.out}: up to date")
        return 0
    written = write(args.out)
    print(f"wrote {len(written)} files under {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
