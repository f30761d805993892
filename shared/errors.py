"""One error hierarchy for every service, and the one place it becomes a JetStream outcome.

A handler raises; it never acks, naks or dead-letters by itself. ``disposition`` maps each
error to what happens to the message, so the policy can be read (and changed) in one screen.
"""

from __future__ import annotations

import enum


class ArteryError(Exception):
    """Base of every error Artery raises on purpose."""


class InvalidMessage(ArteryError):
    """The message can never succeed: dead-letter it with ``kind`` and the reason."""

    def __init__(self, kind: str, reason: str, *, original_id: str | None = None):
        super().__init__(f"{kind}: {reason}")
        self.kind = kind
        self.reason = reason
        self.original_id = original_id


class DependencyUnavailable(ArteryError):
    """A dependency (PostgreSQL, the judge, a replica) is down: retry the message later."""


class ConfigError(ArteryError):
    """Settings are missing or invalid; raised at start, before any connection is made."""


class Disposition(enum.Enum):
    ACK = "ack"
    NAK_WITH_DELAY = "nak"
    TERMINATE_AND_DEAD_LETTER = "term"


def disposition(error: BaseException | None) -> Disposition:
    if error is None:
        return Disposition.ACK
    if isinstance(error, InvalidMessage):
        return Disposition.TERMINATE_AND_DEAD_LETTER
    # Everything else — a dependency outage or a bug — is retried: a bug fixed and redeployed
    # then processes the message, where a dead letter would need a manual replay.
    return Disposition.NAK_WITH_DELAY
