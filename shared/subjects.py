"""Every subject, stream, consumer and bucket name Artery uses, in one place.

Handlers never spell a subject themselves; the AsyncAPI document is generated from this module.
Project and model names may hold dots (``schemas.base.NAME_PATTERN``), and a dot separates
subject tokens and KV key tokens. So every name becomes a token through ``token``, one reversible
escape (``.`` -> ``=2E``; ``=`` is legal in subjects and keys and never in a name), and is read
back through ``name_of``. A name without a dot is its own token, so subjects did not change.
"""

from __future__ import annotations

from dataclasses import dataclass

PREFIX = "artery"

#: What a dot in a name becomes in a subject token or key: ``=`` never occurs in a name, so the
#: escape is unambiguous and reversible (project ``a.b`` is ``a=2Eb``, never ``a`` then ``b``).
DOT_ESCAPE = "=2E"


def token(name: str) -> str:
    """``name`` as one subject token or KV key token. The wildcards ``*`` and ``>`` pass as they
    are, so the helpers below build filters too."""
    return name.replace(".", DOT_ESCAPE)


def name_of(subject_token: str) -> str:
    """The name a token (from ``token``) stands for."""
    return subject_token.replace(DOT_ESCAPE, ".")


def _pm(project: str, model: str) -> str:
    """``<project>.<model>`` as two tokens, each escaped."""
    return f"{token(project)}.{token(model)}"


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
#: object store: each trained step as the trainer saved it (adapter and optimizer state), written by
#: trainers only; the publisher takes the adapter from here, and any trainer worker resumes from it
#: (no disk shared between services: services.trainer, services.publisher)
TRAINER_STATE_BUCKET = "artery_trainer_state"
#: key <project>.<model>: the trainer worker that holds the model's steps; entries expire, so a
#: worker that died frees its models (services.trainer)
TRAINER_LEASES_BUCKET = "artery_trainer_leases"
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
    return f"{PREFIX}.traj.{_pm(project, model)}"


def group_ready(project: str, model: str) -> str:
    return f"{PREFIX}.group.ready.{_pm(project, model)}"


#: Every ``group.ready``, whatever the project and model (the reward service's filter).
GROUPS_READY = f"{PREFIX}.group.ready.>"


def group_scored(project: str, model: str) -> str:
    return f"{PREFIX}.group.scored.{_pm(project, model)}"


def train(kind: str, project: str, model: str) -> str:
    """``kind`` is ``requested``, ``completed`` or ``failed``."""
    return f"{PREFIX}.train.{kind}.{_pm(project, model)}"


#: Every ``checkpoint.saved``, whatever the project and model (the publisher's filter).
CHECKPOINTS_SAVED = f"{PREFIX}.ckpt.saved.>"


def checkpoint(kind: str, project: str, model: str) -> str:
    """``kind`` is ``saved``, ``published`` or ``deleted``."""
    return f"{PREFIX}.ckpt.{kind}.{_pm(project, model)}"


def checkpoint_staged(project: str, model: str) -> str:
    """A step's adapter stored before its state (``CheckpointStaged``): a hint to replicas, on
    core NATS; outside ``ARTERY_CHECKPOINTS``, whose events are each a durable fact."""
    return f"{PREFIX}.staged.ckpt.{_pm(project, model)}"


def control(action: str, project: str, model: str) -> str:
    """``action`` is ``pause`` or ``resume``; request/reply, no stream."""
    return f"{PREFIX}.control.inference.{_pm(project, model)}.{action}"


def retention_request(project: str, model: str) -> str:
    """Ask the publisher to apply retention now; request/reply, no stream."""
    return f"{PREFIX}.control.publisher.{_pm(project, model)}.retain"


def register_request(project: str, model: str) -> str:
    """Ask the control plane (the publisher) to register a model; request/reply, no stream.
    Agents never write the models bucket themselves (``services.publisher.registry``)."""
    return f"{PREFIX}.control.publisher.{_pm(project, model)}.register"


def replicas_request(project: str, model: str) -> str:
    """Ask the control plane for a model's live replicas; request/reply, no stream. Agents
    create no consumers: the publisher reads the replicas bucket on their behalf."""
    return f"{PREFIX}.control.publisher.{_pm(project, model)}.replicas"


def dead_letter(service: str) -> str:
    return f"{PREFIX}.dlq.{service}"


def model_key(project: str, model: str) -> str:
    return _pm(project, model)


def replica_key(project: str, model: str, replica_id: str) -> str:
    """A replica's heartbeat key: under its project, so that reading can be granted per project."""
    return f"{_pm(project, model)}.{replica_id}"


def replica_keys(project: str, model: str) -> str:
    """The key filter of every replica of ``project``/``model``."""
    return f"{_pm(project, model)}.>"


def project_keys(project: str) -> str:
    """The key filter of everything of ``project`` in a bucket keyed ``<project>.<model>...``."""
    return f"{token(project)}.>"


def names_of_key(key: str) -> tuple[str, str] | None:
    """(project, model) of a ``model_key``, or None when it is not one."""
    parts = key.split(".")
    return (name_of(parts[0]), name_of(parts[1])) if len(parts) == 2 else None


def kv_updates(bucket: str, keys: str) -> str:
    """The subject a KV bucket's puts and deletes of ``keys`` are published on: a plain
    subscription hears each change as it is stored (no consumer, so permissions can scope it)."""
    return f"$KV.{bucket}.{keys}"


def parse_trajectories(subject: str) -> tuple[str, str] | None:
    """(project, model) of a trajectory subject, or None when it is not one."""
    parts = subject.split(".")
    if len(parts) != 4 or parts[:2] != [PREFIX, "traj"]:
        return None
    return name_of(parts[2]), name_of(parts[3])


def covers(subject_filter: str, subject: str) -> bool:
    """Whether NATS delivers ``subject`` to ``subject_filter``: ``*`` is one token, ``>`` the rest."""
    want, have = subject_filter.split("."), subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(have) > i
        if i >= len(have) or (token != "*" and token != have[i]):
            return False
    return len(want) == len(have)
