"""Trainer ↔ inference replicas: pause with a lease, resume, and the replicas' acks.

These travel as NATS request/reply (no stream): a pause that nobody answers must fail fast,
not wait in a stream for a replica that may never come back.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from artery.schemas.base import Event, EventId, Name, Struct, Timestamp


class PauseInference(Event, kw_only=True, tag="control.pause"):
    """Stop admitting requests until resumed or until the lease runs out, whichever is first.

    A trainer renews the lease by sending the same ``lease_id`` again before it expires.
    """

    lease_id: EventId
    lease_seconds: Annotated[float, msgspec.Meta(gt=0, le=3600)]
    requested_by: str
    #: Release accelerator memory (vLLM sleep) because the trainer shares the GPU.
    free_memory: bool = True


class ResumeInference(Event, kw_only=True, tag="control.resume"):
    """End the pause held under ``lease_id``; a replica resumes at once."""

    lease_id: EventId
    requested_by: str


class PauseAck(Event, kw_only=True, tag="control.pause_ack"):
    replica_id: str
    lease_id: EventId
    paused: bool
    lease_expires_at: Timestamp
    #: Requests that were in flight when the pause arrived and were finished before the ack.
    drained_requests: int = 0
    freed_memory: bool = False
    error: str | None = None


class ResumeAck(Event, kw_only=True, tag="control.resume_ack"):
    """A replica's answer to a resume: it admits requests again."""

    replica_id: str
    lease_id: EventId
    resumed: bool
    #: Why the request was refused (it could not be read, or was for another model); None when read.
    error: str | None = None


class ReplicaInfo(Struct, kw_only=True):
    """A replica's entry in the replica KV bucket, rewritten on every heartbeat."""

    replica_id: str
    project: Name
    model: Name
    engine: str
    url: str
    served: list[str] = []
    paused: bool = False
    lease_id: str | None = None
    heartbeat_at: Timestamp | None = None


ControlMessage = PauseInference | ResumeInference | PauseAck | ResumeAck
