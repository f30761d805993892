"""The envelope every event carries, and the base Struct behaviour set once."""

from __future__ import annotations

import datetime as dt
import os
import re
import time
import uuid
from typing import Annotated

import msgspec

#: Bumped when the set of tags changes; sent in the ``Artery-Schema`` header.
SCHEMA_VERSION = "1"

# Project and model names become NATS subject tokens, KV keys, file paths and served names, so
# they are restricted to characters safe in all of them: no wildcards, whitespace or slashes. A
# dot is allowed (ART's `Qwen2.5-7b-agent`, `v1.2`) but not first or last: ".", ".." and hidden
# names are path-traversal bait. Where a name becomes a subject token or a key, its dots are
# escaped (`shared.subjects.token`), or a dot would split the token in two.
NAME_PATTERN = r"^[A-Za-z0-9_-](?:[A-Za-z0-9_.-]{0,62}[A-Za-z0-9_-])?$"
Name = Annotated[str, msgspec.Meta(pattern=NAME_PATTERN, description="project or model name")]
_NAME = re.compile(NAME_PATTERN)


def name_problem(value: object) -> str | None:
    """Why ``value`` is not a valid project or model name, in words; None when it is one."""
    if not isinstance(value, str):
        return f"a name is a string, not {type(value).__name__}"
    if _NAME.match(value):
        return None
    if not value or len(value) > 64:
        return "a name has 1 to 64 characters"
    if value.startswith(".") or value.endswith("."):
        return "a name may not start or end with a dot (., .. and hidden names are refused)"
    return "a name holds only letters, digits, '_', '-' and '.'"


def check_name(label: str, value: object) -> None:
    """Raise ``ValueError`` naming ``label`` and the reason when ``value`` is not a valid name."""
    problem = name_problem(value)
    if problem is not None:
        raise ValueError(f"{label} {value!r} is not a valid name: {problem} (pattern {NAME_PATTERN})")


# No NUL: ids are keys of PostgreSQL text columns, which cannot hold one (a request carrying one
# failed in the database, again on every redelivery, instead of being rejected once).
EventId = Annotated[
    str,
    msgspec.Meta(min_length=1, max_length=128, pattern=r"^[^\x00]+$", description="globally unique event id"),
]
Step = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1, description="policy version: the training step")]
Split = Annotated[
    str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]{1,32}$", description="train, val, or another split")
]
#: Timestamps must carry a time zone (RFC 3339 with an offset or Z).
Timestamp = Annotated[dt.datetime, msgspec.Meta(tz=True)]


def new_event_id() -> str:
    """A UUIDv7 (time-ordered, so ids sort by creation and index well in PostgreSQL)."""
    ms = time.time_ns() // 1_000_000
    rand = int.from_bytes(os.urandom(10), "big")
    value = (ms & ((1 << 48) - 1)) << 80 | 0x7 << 76 | (rand >> 68 & 0xFFF) << 64
    value |= 0b10 << 62 | rand & ((1 << 62) - 1)
    return str(uuid.UUID(int=value))


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class Struct(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Base for nested wire types: keyword-only, defaults omitted from the encoding."""


class Event(Struct, kw_only=True, tag_field="event"):
    """The envelope: every event on every subject carries these fields.

    ``event`` (the tag) names the event type; ``id`` doubles as the JetStream
    ``Nats-Msg-Id``, so a re-publish of the same event is de-duplicated by the server, and as
    the idempotency key of every database write it causes. It is required on the wire: an id
    invented at decode time would differ on every redelivery. (``new_event_id()`` makes one.)
    """

    id: EventId
    project: Name
    model: Name
    step: Step | None = None
    time: Timestamp = msgspec.field(default_factory=utcnow)
