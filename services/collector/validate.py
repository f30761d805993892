"""Turning raw messages into trusted trajectory groups (pure: no NATS, no database).

The schema (msgspec) checks shapes, types and bounds (token ids); this adds what a type cannot
say: finite numbers everywhere and rewards within ``REWARD_LIMIT`` (the contract's rule, in
``shared.contract``, which the SDK checks too), headers and a subject that agree with the payload,
sizes within bounds. What passes is stored exactly as it was sent; everything else is rejected
with the reason.

Non-finite numbers are ``non_finite`` however they were sent: as msgpack floats, or as the
``NaN``/``Infinity`` literals Python's ``json.dumps`` writes (not JSON, so otherwise a ``decode``
error that names only a byte offset). ``JSON.stringify`` writes them as ``null``: a
``validation`` error naming the field (``Expected `float`, got `null```), since a null is not
necessarily a NaN.

Input edges: objects and arrays nested deeper than ``codec.MAX_NESTING`` in the message, and a
string (an unknown key's included) that is not UTF-8, are ``decode`` (``shared.codec``); a tool
call's ``arguments`` string nesting that deep is ``validation`` (the trainer's chat template parses
it). The group's ``time`` must lie in [``EARLIEST_TIME``, ``LATEST_TIME``) (``validation``): the
database driver stores the first and last datetimes Python has as ``-infinity`` and ``infinity``.

Sizes: a group over ``max_bytes`` (``ARTERY_COLLECTOR_MAX_GROUP_BYTES``) or with more than
``max_trajectories`` trajectories is ``too_large``. The byte limit defaults to the NATS default
``max_payload`` (8 MiB), so with defaults the publishing client refuses a larger message before
it is sent (``MaxPayloadError``): the byte check is for a server whose ``max_payload`` is raised
above what the collector should store (set the collector's limit below it), and is what rejects
the message then.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Mapping

from artery.schemas import SCHEMA_VERSION, TrainRequested, TrajectoryGroupSubmitted
from artery.shared import subjects
from artery.shared.codec import CONTENT_TYPE, EVENT_HEADER, SCHEMA_HEADER, EventDecoder
from artery.shared.contract import check_finite
from artery.shared.errors import InvalidMessage

#: The range of a sane event time. Nothing Artery records predates the Unix epoch, and a clock a
#: few decades fast is still let through; beyond these, a time is a mistake or a probe.
EARLIEST_TIME = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
LATEST_TIME = dt.datetime(2100, 1, 1, tzinfo=dt.UTC)

# A tagged union, so that the ``event`` tag is required (msgspec takes a lone tagged struct
# without its tag): an event of another type is then told apart from a group without a tag.
_decoder = EventDecoder(TrajectoryGroupSubmitted | TrainRequested)
_GROUP_TAG = TrajectoryGroupSubmitted.__struct_config__.tag
#: msgspec's JSON syntax error, with the offset of the byte it stopped at.
_BAD_BYTE = re.compile(r"invalid character \(byte (\d+)\)")
#: What ``json.dumps`` (allow_nan, its default) writes for NaN and the infinities.
_NON_FINITE_LITERALS = (b"NaN", b"Infinity")


def decode_group(
    subject: str,
    data: bytes,
    headers: Mapping[str, str] | None,
    *,
    max_bytes: int,
    max_trajectories: int,
) -> TrajectoryGroupSubmitted:
    headers = headers or {}
    if len(data) > max_bytes:
        raise InvalidMessage("too_large", f"{len(data)} bytes is more than the limit of {max_bytes}")
    if not data:
        raise InvalidMessage("decode", "empty message")
    check_headers(headers)
    try:
        group = _decoder.decode(data, headers.get(CONTENT_TYPE))
    except InvalidMessage as exc:
        non_finite = _non_finite_literal(exc, data)
        if non_finite is None:
            raise
        raise non_finite from None
    if not isinstance(group, TrajectoryGroupSubmitted):
        raise InvalidMessage(
            "wrong_event", f"a {type(group).__name__} is not a trajectory group", original_id=group.id
        )
    names = subjects.parse_trajectories(subject)
    if names != (group.project, group.model):
        raise InvalidMessage(
            "subject_mismatch",
            f"published on {subject!r} but names project {group.project!r} and model {group.model!r}",
            original_id=group.id,
        )
    if len(group.trajectories) > max_trajectories:
        raise InvalidMessage(
            "too_large",
            f"{len(group.trajectories)} trajectories is more than the limit of {max_trajectories}",
            original_id=group.id,
        )
    check_finite(group)
    check_time(group)
    return group


def check_time(group: TrajectoryGroupSubmitted) -> None:
    """The group's ``time`` lies in [``EARLIEST_TIME``, ``LATEST_TIME``)."""
    try:  # PostgreSQL stores it in UTC, where it must still be a valid datetime
        in_utc = group.time.astimezone(dt.UTC)
    except OverflowError:
        raise InvalidMessage(
            "validation", f"time {group.time.isoformat()} is out of range in UTC", original_id=group.id
        ) from None
    if not EARLIEST_TIME <= in_utc < LATEST_TIME:
        raise InvalidMessage(
            "validation",
            f"time {group.time.isoformat()} is outside {EARLIEST_TIME.date()} to {LATEST_TIME.date()}",
            original_id=group.id,
        )


def _non_finite_literal(error: InvalidMessage, data: bytes) -> InvalidMessage | None:
    """A JSON syntax error at a ``NaN``/``Infinity`` literal, as ``non_finite``; else None."""
    match = _BAD_BYTE.search(error.reason) if error.kind == "decode" else None
    if match is None:
        return None
    at = int(match.group(1))
    literal = next((lit for lit in _NON_FINITE_LITERALS if data.startswith(lit, at)), None)
    if literal is None:
        return None
    sign = "-" if at > 0 and data[at - 1 : at] == b"-" else ""
    return InvalidMessage(
        "non_finite",
        f"{sign}{literal.decode()} at byte {at}: JSON has no NaN or infinities "
        "(json.dumps writes them unless allow_nan=False); send a finite number",
    )


def check_headers(headers: Mapping[str, str]) -> None:
    """The optional ``Artery-Event`` and ``Artery-Schema`` headers must agree with the payload."""
    event = headers.get(EVENT_HEADER)
    if event is not None and event != _GROUP_TAG:
        raise InvalidMessage("header_mismatch", f"{EVENT_HEADER} {event!r} on a {_GROUP_TAG!r} subject")
    schema = headers.get(SCHEMA_HEADER)
    if schema is not None and schema != SCHEMA_VERSION:
        raise InvalidMessage(
            "header_mismatch", f"{SCHEMA_HEADER} {schema!r}: this collector reads version {SCHEMA_VERSION!r}"
        )
