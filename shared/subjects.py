"""Every subject, stream, consumer and bucket name Artery uses, in one place.

Handlers never spell a subject themselves; the AsyncAPI document is generated from this module.
Project and model names are single subject tokens (see ``schemas.base.NAME_PATTERN``).
"""

from __future__ import annotations

from dataclasses import dataclass

PREFIX = "artery"


@dataclass(frozen=True)
class StreamSpec:
    name: str
    subjects: tuple[str, ...]
    description: str
    #: Direct gets (``$JS.API.DIRECT.GET.<stream>.<subject>``): the last message of a subject,
    #: read without a consumer, and grantable per subject.
    direct: bool = False
    #: Agents publish into it. Its ``Nats-Msg-Id`` de-duplication, one window shared by every
    #: tenant, is then kept at JetStream's minimum: with the usual window, one project could
    #: suppress another's message by publishing its id first. Its consumers are idempotent on
    #: (project, model, id) in PostgreSQL instead.
    agent_written: bool = False


TRAJECTORIES = StreamSpec(
    "ARTERY_TRAJECTORIES",
    (f"{PREFIX}.traj.>",),
    "trajectory groups published by agents",
    agent_written=True,
)
GROUPS = StreamSpec("ARTERY_GROUPS", (f"{PREFIX}.group.>",), "stored groups: ready for reward, then scored")
TRAINING = StreamSpec(
    "ARTERY_TRAINING", (f"{PREFIX}.train.>",), "train requests and their outcomes", agent_written=True
)
CHECKPOINTS = StreamSpec(
    "ARTERY_CHECKPOINTS", (f"{PREFIX}.ckpt.>",), "adapters saved, published and deleted", direct=True
)
DLQ = StreamSpec("ARTERY_DLQ", (f"{PREFIX}.dlq.>",), "rejected input with the reason")

STREAMS: tuple[StreamSpec, ...] = (TRAJECTORIES, GROUPS, TRAINING, CHECKPOINTS, DLQ)

# Durable consumers, one per role: replicas of a service share it and split the work.
COLLECTOR_CONSUMER = "collector"
PUBLISHER_CONSUMER = "publisher"
REWARD_CONSUMER = "reward"

# Key-value buckets and the object store.
MODELS_BUCKET = "artery_models"  # key <project>.<model>: registration and current step
REPLICAS_BUCKET = "artery_replicas"  # key <project>.<model>.<replica id>: heartbeat (entries expire)
ADAPTERS_BUCKET = "artery_adapters"  # object store: LoRA adapters
#: key <project>.<model>.<digest of the group id>: a judge's verdict, kept from the moment it is paid
#: for until PostgreSQL has it (services.reward.verdicts)
VERDICTS_BUCKET = "artery_verdicts"

#: The NATS service a ready service process answers as, ``artery-<service>`` (NATS's own service
#: protocol: ``$SRV.PING|INFO|STATS[.<name>[.<id>]]``, what ``nats micro ping`` asks; see
#: ``shared.health``). A service name, not an Artery subject: no channel in the contract.
HEALTH_SERVICE = PREFIX + "-{service}"
#: Subjects of that protocol: the requests a ready service answers.
HEALTH_REQUESTS = "$SRV.>"


def trajectories(project: str, model: str) -> str:
    return f"{PREFIX}.traj.{project}.{model}"


def group_ready(project: str, model: str) -> str:
    return f"{PREFIX}.group.ready.{project}.{model}"


#: Every ``group.ready``, whatever the project and model (the reward service's filter).
GROUPS_READY = f"{PREFIX}.group.ready.>"


def group_scored(project: str, model: str) -> str:
    return f"{PREFIX}.group.scored.{project}.{model}"


def train(kind: str, project: str, model: str) -> str:
    """``kind`` is ``requested``, ``completed`` or ``failed``."""
    return f"{PREFIX}.train.{kind}.{project}.{model}"


#: Every ``checkpoint.saved``, whatever the project and model (the publisher's filter).
CHECKPOINTS_SAVED = f"{PREFIX}.ckpt.saved.>"


def checkpoint(kind: str, project: str, model: str) -> str:
    """``kind`` is ``saved``, ``published`` or ``deleted``."""
    return f"{PREFIX}.ckpt.{kind}.{project}.{model}"


def control(action: str, project: str, model: str) -> str:
    """``action`` is ``pause`` or ``resume``; request/reply, no stream."""
    return f"{PREFIX}.control.inference.{project}.{model}.{action}"


def retention_request(project: str, model: str) -> str:
    """Ask the publisher to apply retention now; request/reply, no stream."""
    return f"{PREFIX}.control.publisher.{project}.{model}.retain"


def register_request(project: str, model: str) -> str:
    """Ask the control plane (the publisher) to register a model; request/reply, no stream.
    Agents never write the models bucket themselves (``services.publisher.registry``)."""
    return f"{PREFIX}.control.publisher.{project}.{model}.register"


def replicas_request(project: str, model: str) -> str:
    """Ask the control plane for a model's live replicas; request/reply, no stream. Agents
    create no consumers: the publisher reads the replicas bucket on their behalf."""
    return f"{PREFIX}.control.publisher.{project}.{model}.replicas"


def dead_letter(service: str) -> str:
    return f"{PREFIX}.dlq.{service}"


def model_key(project: str, model: str) -> str:
    return f"{project}.{model}"


def replica_key(project: str, model: str, replica_id: str) -> str:
    """A replica's heartbeat key: under its project, so that reading can be granted per project."""
    return f"{project}.{model}.{replica_id}"


def replica_keys(project: str, model: str) -> str:
    """The key filter of every replica of ``project``/``model``."""
    return f"{project}.{model}.>"


def kv_updates(bucket: str, keys: str) -> str:
    """The subject a KV bucket's puts and deletes of ``keys`` are published on: a plain
    subscription hears each change as it is stored (no consumer, so permissions can scope it)."""
    return f"$KV.{bucket}.{keys}"


def parse_trajectories(subject: str) -> tuple[str, str] | None:
    """(project, model) of a trajectory subject, or None when it is not one."""
    parts = subject.split(".")
    if len(parts) != 4 or parts[:2] != [PREFIX, "traj"]:
        return None
    return parts[2], parts[3]


def covers(subject_filter: str, subject: str) -> bool:
    """Whether NATS delivers ``subject`` to ``subject_filter``: ``*`` is one token, ``>`` the rest."""
    want, have = subject_filter.split("."), subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(have) > i
        if i >= len(have) or (token != "*" and token != have[i]):
            return False
    return len(want) == len(have)
