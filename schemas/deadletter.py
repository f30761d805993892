"""Rejected input, kept with the reason: nothing is ever silently dropped."""

from __future__ import annotations

from typing import Literal

from artery.schemas.base import Event

#: Project/model names used when the rejected message did not say (or said something invalid).
UNKNOWN = "_unknown"


class DeadLetter(Event, kw_only=True, tag="dead_letter"):
    """A message a service rejected for good, with the reason and the bytes (cut to a limit)."""

    service: str
    reason: str
    #: Machine-readable class of the failure (``decode``, ``validation``, ``too_large``, ...).
    kind: str
    subject: str
    stream: str | None = None
    stream_seq: int | None = None
    #: The id the rejected message claimed, if any could be read.
    original_id: str | None = None
    headers: dict[str, str] = {}
    content_type: str | None = None
    #: The rejected bytes (base64 in JSON), cut to the collector's dead-letter size limit.
    payload: bytes = b""
    payload_truncated: bool = False
    disposition: Literal["terminated"] = "terminated"
