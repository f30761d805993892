"""NATS users with least-privilege permissions, one role per service, generated from ``subjects``.

Every subject, stream, durable consumer and bucket below comes from :mod:`artery.shared.subjects`,
so a renamed subject changes the permissions with it. ``render_authorization`` turns users into
the ``authorization { users = [...] }`` block of a nats-server configuration, each password as a
bcrypt hash: the server checks a client's plain password against it, and the file never holds one.

What JetStream needs, found against a real nats-server (``tests/test_security.py``):

- a JetStream publish is a request: publish on the subject, the stream's ack comes back on the
  client's inbox. Every user gets its own inbox prefix ``_INBOX.<user>`` (``auth`` sets it on
  connect) and may subscribe to that only, so nobody reads another client's replies;
- a durable pull consumer: ``$JS.API.CONSUMER.INFO|CREATE.<stream>.<durable>[.<filter>]``,
  ``$JS.API.CONSUMER.MSG.NEXT.<stream>.<durable>`` and acks on ``$JS.ACK.<stream>.<durable>.>``;
- an ordered consumer (object get): ``$JS.API.STREAM.NAMES``,
  ``$JS.API.CONSUMER.CREATE.<stream>`` and flow-control replies on ``$JS.FC.<stream>.>``. The
  consumer's name is in the body there, not the subject: the server refuses a ``durable_name``
  but takes a ``name``, so whoever may create one on a stream may also change the settings of an
  existing consumer of that stream. Nobody holds this on a stream with a durable consumer:
  inference follows checkpoints by subscribing and reads the last one by direct get;
- KV: ``$JS.API.STREAM.INFO.KV_<bucket>`` to open a bucket (agents open the models bucket
  without it, ``registry.models_kv``); gets through ``$JS.API.DIRECT.GET.KV_<bucket>.<key
  subject>`` (the models bucket allows direct gets), so an agent reads its own project's records
  only; listing keys (replicas) through a consumer whose filter is in the create subject
  (``shared.kv``); writes on ``$KV.<bucket>.<key>``;
- object store: ``$JS.API.STREAM.INFO|MSG.GET.OBJ_<bucket>``, ``$JS.API.DIRECT.GET.OBJ_<bucket>``
  (batched reads) and an ordered consumer to read;
  chunks on ``$O.<bucket>.C.>``, metadata on ``$O.<bucket>.M.>`` and
  ``$JS.API.STREAM.PURGE.OBJ_<bucket>`` to write or delete.

Agents get exactly what the SDK sends, each scoped to their project: their events, their
requests to the publisher (register a model, list its replicas, apply retention),
``STREAM.NAMES`` and direct gets of their own model records. No ``$KV.``/``$O.`` publish (those
streams honour ``Nats-Rollup``, which permissions cannot filter), no ``STREAM.INFO`` (its
``subjects_filter`` lists every tenant's subjects and counts), no consumer (nothing to exhaust
or hijack by name): ``tests/test_tenant_isolation.py`` tries each as a hostile agent.

Only ``admin`` may create or change streams, buckets and consumers of others; a service checks
that they exist (``provision_if_missing``, by ``STREAM.NAMES``) instead of creating them.
``admin`` is also the operator's credential for the console's two actions: re-publishing a dead
letter onto the subject it came from (the subjects the durable consumers read) and resuming a
stuck replica (resume, never pause). The console itself runs as ``console``: it reads, and publishes nothing.

Every service role answers NATS readiness requests (``shared.health``: NATS's service protocol,
``$SRV.PING|INFO|STATS``) for its own service name only; ``admin`` may ask them.

Long module: every role's rights side by side in one function (``permissions``), so that what one
role may do is read against the others; the subject helpers above it are its vocabulary.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from artery.schemas.base import NAME_PATTERN, check_name
from artery.shared import subjects
from artery.shared.kv import kv_stream

ROLES = ("admin", "agent", "collector", "reward", "trainer", "publisher", "inference", "console")

JS_API = "$JS.API"
#: The trainer's durable consumer (named in ``services.trainer.service``; a test keeps them equal).
TRAINER_CONSUMER = "trainer"
#: Each service's durable consumer: (stream, durable, filter subject).
DURABLES: dict[str, tuple[subjects.StreamSpec, str, str]] = {
    "collector": (subjects.TRAJECTORIES, subjects.COLLECTOR_CONSUMER, subjects.TRAJECTORIES.subjects[0]),
    "reward": (subjects.GROUPS, subjects.REWARD_CONSUMER, subjects.GROUPS_READY),
    "trainer": (subjects.TRAINING, TRAINER_CONSUMER, subjects.train("requested", "*", "*")),
    "publisher": (subjects.CHECKPOINTS, subjects.PUBLISHER_CONSUMER, subjects.CHECKPOINTS_SAVED),
}

_NAME = re.compile(NAME_PATTERN)


@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    deny_publish: tuple[str, ...] = ()
    #: May answer requests it received (on their reply subject only, once each).
    allow_responses: bool = False


@dataclass(frozen=True)
class NatsUser:
    name: str
    role: str
    password: str = field(repr=False)
    #: Agents only: the project whose subjects the agent may use.
    project: str | None = None

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"unknown role {self.role!r}; one of {', '.join(ROLES)}")
        if not _NAME.match(self.name):
            raise ValueError(f"user name {self.name!r} must match {NAME_PATTERN} (it is an inbox token)")
        if (self.role == "agent") != (self.project is not None):
            raise ValueError("a project is given for agent users, and only for them")
        if self.project is not None:
            check_name("project", self.project)
        if not self.password or any(c in self.password for c in '"\\\n'):
            raise ValueError(f"password of {self.name!r} is empty or has a quote, backslash or newline")


def inbox_prefix(user: str) -> str:
    """The inbox prefix a user's client must use (``auth.nats_connect_options`` sets it): one
    token, so a user ``agent-a.b`` is escaped like a name (``subjects.token``), never read as
    ``_INBOX.agent-a`` plus a token ``b``."""
    return f"_INBOX.{subjects.token(user)}"


def _obj_stream(bucket: str) -> str:
    return f"OBJ_{bucket}"


def _provisioned() -> list[str]:
    """Every stream ``bus.provision`` creates, buckets included."""
    return [
        *(s.name for s in subjects.STREAMS),
        kv_stream(subjects.MODELS_BUCKET),
        kv_stream(subjects.REPLICAS_BUCKET),
        kv_stream(subjects.VERDICTS_BUCKET),
        kv_stream(subjects.TRAINER_LEASES_BUCKET),
        _obj_stream(subjects.ADAPTERS_BUCKET),
        _obj_stream(subjects.TRAINER_STATE_BUCKET),
    ]


def _all_stream_info() -> list[str]:
    """Read-only, for services (``provision_if_missing`` needs only ``STREAM.NAMES``)."""
    return [f"{JS_API}.STREAM.INFO.{name}" for name in _provisioned()]


def _durable(role: str) -> list[str]:
    stream, durable, _ = DURABLES[role]
    s = stream.name
    return [
        f"{JS_API}.CONSUMER.INFO.{s}.{durable}",
        f"{JS_API}.CONSUMER.CREATE.{s}.{durable}",
        f"{JS_API}.CONSUMER.CREATE.{s}.{durable}.>",  # the filter subject is part of the name
        f"{JS_API}.CONSUMER.DURABLE.CREATE.{s}.{durable}",
        f"{JS_API}.CONSUMER.MSG.NEXT.{s}.{durable}",
        f"$JS.ACK.{s}.{durable}.>",
    ]


def _ordered(stream: str) -> list[str]:
    """An ordered (ephemeral push) consumer: what ``js.subscribe(ordered_consumer=True)`` sends."""
    return [
        f"{JS_API}.STREAM.NAMES",
        f"{JS_API}.CONSUMER.CREATE.{stream}",
        f"{JS_API}.CONSUMER.INFO.{stream}.*",
        f"$JS.FC.{stream}.>",
    ]


def _kv_read(bucket: str, keys: str = ">") -> list[str]:
    """Gets of ``keys``: the models bucket is ``allow_direct``, and a direct get names the key
    in its subject (a STREAM.MSG.GET names it in the body, where permissions cannot see it)."""
    return [f"{JS_API}.DIRECT.GET.{kv_stream(bucket)}.$KV.{bucket}.{keys}"]


def _kv_scan(bucket: str, keys: str = ">") -> list[str]:
    """Reading every key that matches ``keys`` (``shared.kv.latest_values``): a consumer named and
    filtered in its subject, delivered to the user's inbox, removed by the server once the
    reader stops listening (a delete cannot be scoped by name, so it is nobody's to send)."""
    return [f"{JS_API}.CONSUMER.CREATE.{kv_stream(bucket)}.*.$KV.{bucket}.{keys}"]


#: Stream and consumer administration, denied to agents outright (on top of their allow-list):
#: an agent's credentials must never change, empty or remove what other tenants depend on.
AGENT_DENIED_ADMIN = tuple(
    f"{JS_API}.{operation}.>"
    for operation in (
        "STREAM.CREATE",
        "STREAM.UPDATE",
        "STREAM.DELETE",
        "STREAM.PURGE",
        "STREAM.MSG.DELETE",
        "STREAM.SNAPSHOT",
        "STREAM.RESTORE",
        "STREAM.PEER",
        "STREAM.LEADER",
        "CONSUMER.DELETE",
        "CONSUMER.PAUSE",
        "CONSUMER.UNPIN",
        "CONSUMER.LEADER",
        "CONSUMER.DURABLE",
        "META",
        "SERVER",
        "ACCOUNT",
    )
)


#: Every KV and object-store subject. Their streams honour ``Nats-Rollup`` headers (a rollup
#: purges the stream, or a subject) and permissions cannot filter headers, so agents must not
#: publish there at all: model records are written by the publisher (``registry``).
AGENT_DENIED_STORES = ("$KV.>", "$O.>")


def _kv_write(bucket: str, keys: str = ">") -> list[str]:
    return [f"$KV.{bucket}.{keys}"]


def _object_get(bucket: str) -> list[str]:
    """An object's metadata and chunks, message by message or in batched direct gets
    (``object_store.read_object``): no consumer, so none is left behind when retention deletes the
    object mid-read."""
    stream = _obj_stream(bucket)
    return [f"{JS_API}.STREAM.MSG.GET.{stream}", f"{JS_API}.DIRECT.GET.{stream}"]


def _object_read(bucket: str) -> list[str]:
    """``_object_get`` and nats-py's own ``ObjectStore.get`` (an ordered consumer)."""
    return [*_object_get(bucket), *_ordered(_obj_stream(bucket))]


def _object_write(bucket: str) -> list[str]:
    return [f"$O.{bucket}.C.>", f"$O.{bucket}.M.>", f"{JS_API}.STREAM.PURGE.{_obj_stream(bucket)}"]


def _protect_durables(own: str | None) -> list[str]:
    """Nobody but its service creates, changes or deletes a service's durable consumer."""
    denied = []
    for role, (stream, durable, _) in DURABLES.items():
        if role == own:
            continue
        s = stream.name
        denied += [
            f"{JS_API}.CONSUMER.CREATE.{s}.{durable}",
            f"{JS_API}.CONSUMER.CREATE.{s}.{durable}.>",
            f"{JS_API}.CONSUMER.DURABLE.CREATE.{s}.{durable}",
            f"{JS_API}.CONSUMER.DELETE.{s}.{durable}",
        ]
    return denied


def _control_inference() -> str:
    return f"{subjects.PREFIX}.control.inference.>"


#: What an operator may re-publish a dead letter onto: the subjects the durable consumers read
#: (``DURABLES``), where the message is handled again. Request/reply subjects are not replayed.
REPUBLISHABLE = tuple(filter_subject for _, _, filter_subject in DURABLES.values())


def _health(role: str) -> list[str]:
    """The NATS service protocol's requests a ready ``role`` service answers (``shared.health``):
    to everyone, to its service name, to its instance."""
    name = subjects.HEALTH_SERVICE.format(service=role)
    return [
        *(f"$SRV.{verb}" for verb in ("PING", "INFO", "STATS")),
        f"$SRV.*.{name}",
        f"$SRV.*.{name}.*",
    ]


def permissions(role: str, user: str, *, project: str | None = None) -> Permissions:
    """What ``user`` in ``role`` may publish and subscribe to (``project``: agents only)."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; one of {', '.join(ROLES)}")
    inbox = f"{inbox_prefix(user)}.>"
    models, replicas, adapters = subjects.MODELS_BUCKET, subjects.REPLICAS_BUCKET, subjects.ADAPTERS_BUCKET
    state, leases = subjects.TRAINER_STATE_BUCKET, subjects.TRAINER_LEASES_BUCKET
    # Nobody but the trainer pauses inference or writes what it trained (and holds models);
    # nobody but the publisher writes adapters.
    deny = [_control_inference()] if role != "trainer" else []
    if role != "publisher":
        deny.append(f"$O.{adapters}.>")
    if role != "trainer":
        deny += [f"$O.{state}.>", f"$KV.{leases}.>"]
    deny += _protect_durables(role if role in DURABLES else None)
    if role == "admin":
        # Provisioning and operations: the whole JetStream API, reading everything, asking every
        # service whether it is ready, re-publishing dead letters and resuming a stuck replica (the
        # console's actions). No other events, no pausing, no adapters: those belong to the services.
        denied = [subjects.control("pause", "*", "*") if d == _control_inference() else d for d in deny]
        return Permissions(
            publish=(
                f"{JS_API}.>",
                "$JS.ACK.>",
                "$JS.FC.>",
                subjects.HEALTH_REQUESTS,
                *REPUBLISHABLE,
                subjects.control("resume", "*", "*"),
            ),
            subscribe=(">",),
            deny_publish=tuple(d for d in denied if not d.startswith(f"{JS_API}.CONSUMER")),
        )
    if role == "agent":
        if project is None:
            raise ValueError("an agent user needs its project")
        # Exactly what the SDK sends, each scoped to the agent's project. Nothing on a stream
        # that honours Nats-Rollup (KV, object store: ``AGENT_DENIED_STORES``), no STREAM.INFO
        # (its subjects_filter lists every tenant's subjects and counts), no consumer of its
        # own (the publisher lists replicas on its behalf): no quota to exhaust, no name to
        # hijack.
        return Permissions(
            publish=(
                subjects.trajectories(project, ">"),
                subjects.train("requested", project, ">"),
                subjects.retention_request(project, "*"),  # the SDK's delete_checkpoints()
                subjects.register_request(project, "*"),  # register(), written by the publisher
                subjects.replicas_request(project, "*"),  # finding a replica's URL
                f"{JS_API}.STREAM.NAMES",  # provision_if_missing: names only, the same for all
                *_kv_read(models, subjects.model_key(project, "*")),  # its own models' records only
            ),
            subscribe=(
                subjects.train("*", project, ">"),
                # train() returns when every replica serves the new step: it hears their
                # registry entries change instead of polling them.
                subjects.kv_updates(replicas, subjects.project_keys(project)),
                inbox,
            ),
            deny_publish=(*deny, *AGENT_DENIED_ADMIN, *AGENT_DENIED_STORES),
        )
    if project is not None:
        raise ValueError("only agent users have a project")
    publish = [f"{JS_API}.STREAM.NAMES", *_all_stream_info(), *(_durable(role) if role in DURABLES else [])]
    subscribe: list[str] = [inbox, *_health(role)]
    responses = True  # readiness answers; other requests only where subscribed below
    if role == "collector":
        publish += [subjects.group_ready("*", "*")]
    elif role == "reward":
        verdicts = subjects.VERDICTS_BUCKET
        publish += [subjects.group_scored("*", "*"), *_kv_read(verdicts), *_kv_write(verdicts)]
    elif role == "trainer":
        # A request waits for its groups to be stored (and judged): woken by these, not a timer.
        subscribe += [subjects.group_ready("*", "*"), subjects.group_scored("*", "*")]
        publish += [
            subjects.train("completed", "*", "*"),
            subjects.train("failed", "*", "*"),
            subjects.checkpoint("saved", "*", "*"),
            subjects.checkpoint_staged("*", "*"),
            subjects.control("pause", "*", "*"),
            subjects.control("resume", "*", "*"),
            *_kv_read(models),
            *_kv_write(models),  # advances each model's step
            *_kv_scan(replicas),  # whom to wait for when pausing
            # Each step's adapter and optimizer state, which any worker of the pool resumes from,
            # and the lease that keeps a model's steps on one worker at a time.
            *_object_read(state),
            *_object_write(state),
            *_kv_read(leases),
            *_kv_write(leases),
            # Is a lease's holder alive? The trainers' own readiness ping (shared.health) says.
            f"$SRV.PING.{subjects.HEALTH_SERVICE.format(service='trainer')}",
            f"$SRV.PING.{subjects.HEALTH_SERVICE.format(service='trainer')}.*",
        ]
    elif role == "publisher":
        publish += [
            subjects.checkpoint("published", "*", "*"),
            subjects.checkpoint("deleted", "*", "*"),
            *_object_read(state),  # the adapter a trainer saved, from whichever host it runs on
            *_object_read(adapters),
            *_object_write(adapters),
            *_kv_read(models),
            *_kv_write(models),  # registrations, on agents' behalf (services.publisher.registry)
            *_kv_scan(replicas),  # replica listings, on agents' behalf
        ]
        subscribe += [
            subjects.retention_request("*", "*"),
            subjects.register_request("*", "*"),
            subjects.replicas_request("*", "*"),
            # Its own announcements: a retention request waits for the step the registry names.
            subjects.checkpoint("published", "*", "*"),
        ]
    elif role == "inference":
        published = subjects.checkpoint("published", "*", "*")
        publish += [
            # The last published adapter, by direct get: no consumer on ARTERY_CHECKPOINTS.
            f"{JS_API}.DIRECT.GET.{subjects.CHECKPOINTS.name}.{published}",
            *_object_get(adapters),  # published adapters (``adapters.read_adapter``)
            # The same, for a step as the trainer saved it, before the publisher has copied it
            # (``load_saved_adapters``): from the trainers' store, wherever they run.
            *_object_get(state),
            *_kv_write(replicas),  # its heartbeat
        ]
        subscribe += [
            subjects.control("pause", "*", "*"),
            subjects.control("resume", "*", "*"),
            published,  # followed live (services.inference.checkpoints)
            # A step as soon as the trainer saved it (read from the trainers' store), and its
            # adapter fetched ahead while the trainer stores the step's state.
            subjects.checkpoint("saved", "*", "*"),
            subjects.checkpoint_staged("*", "*"),
            subjects.checkpoint("deleted", "*", "*"),
        ]  # and answers pause and resume on the requester's inbox only
    elif role == "console":
        # Reads only: what the pages show (model records, replicas, dead letters by sequence)
        # and the live feed, subscribed to the subjects the streams store. It publishes nothing;
        # its actions connect with the operator's admin credential instead (services.console).
        publish += [
            *_kv_scan(models),
            *_kv_scan(replicas),
            f"{JS_API}.STREAM.MSG.GET.{subjects.DLQ.name}",
        ]
        subscribe += [
            f"{subjects.PREFIX}.train.>",
            f"{subjects.PREFIX}.ckpt.>",
            f"{subjects.PREFIX}.group.>",
            subjects.dead_letter("*"),
            subjects.kv_updates(replicas, ">"),
        ]
    if role != "console":
        publish.append(subjects.dead_letter(role))
    return Permissions(
        publish=tuple(dict.fromkeys(publish)),
        subscribe=tuple(subscribe),
        deny_publish=tuple(dict.fromkeys(deny)),
        allow_responses=responses,
    )


def default_users(projects: Iterable[str], password=lambda: secrets.token_urlsafe(24)) -> list[NatsUser]:
    """One user per service role (named after it), and ``agent-<project>`` for each project."""
    users = [NatsUser(role, role, password()) for role in ROLES if role != "agent"]
    users += [NatsUser(f"agent-{p}", "agent", password(), project=p) for p in dict.fromkeys(projects)]
    return users


def _q(value: str) -> str:
    # Quoted: an unquoted ``$JS...`` would be read as a variable reference.
    return json.dumps(value)


def _list(values: Sequence[str]) -> str:
    return "[" + ", ".join(_q(v) for v in values) + "]"


#: bcrypt cost of the hashes in the rendered configuration. nats-server checks the hash on every
#: connection, and each step of cost doubles that: measured on 2 cores, about 50 ms per connect
#: at 10 and 90 ms at 11. The passwords are random 24-byte tokens (192 bits), beyond guessing
#: at any cost: a higher cost would buy nothing but slower connects, reconnects and tests.
BCRYPT_COST = 10


def hash_password(password: str, cost: int = BCRYPT_COST) -> str:
    """A bcrypt hash of ``password`` for a nats-server configuration, salted afresh on each call."""
    # Imported here: only whoever writes the server's configuration needs it, not every client.
    import bcrypt

    # $2a$: the prefix nats-server's own mkpasswd writes.
    return bcrypt.hashpw(password.encode(), bcrypt.gensalt(cost, prefix=b"2a")).decode()


def render_authorization(users: Sequence[NatsUser]) -> str:
    """The ``authorization`` block of a nats-server configuration for ``users``, passwords hashed
    (``hash_password``): clients connect with the plain password, the file holds none."""
    names = [u.name for u in users]
    if len(set(names)) != len(names):
        raise ValueError("user names must be unique")
    lines = ["authorization {", "  users = ["]
    for user in users:
        p = permissions(user.role, user.name, project=user.project)
        lines += [
            f"    # role {user.role}" + (f", project {user.project}" if user.project else ""),
            # Quoted (``_q``): unquoted, the hash's ``$2a$...`` would read as a variable reference.
            f"    {{ user: {_q(user.name)}, password: {_q(hash_password(user.password))}, permissions: {{",
            f"        publish: {{ allow: {_list(p.publish)}"
            + (f", deny: {_list(p.deny_publish)}" if p.deny_publish else "")
            + " }",
            f"        subscribe: {{ allow: {_list(p.subscribe)} }}",
            *(["        allow_responses: true"] if p.allow_responses else []),
            "    } }",
        ]
    lines += ["  ]", "}"]
    return "\n".join(lines) + "\n"


async def provision_if_missing(js, settings) -> bool:
    """Provision only when a stream or bucket is missing; True when it provisioned.

    Services and agents call this instead of ``bus.provision``: checking needs only
    ``$JS.API.STREAM.INFO``, which every role has, while creating needs the admin role.
    """
    from artery.shared import bus  # here: bus imports auth, which imports this module

    if set(_provisioned()) <= await stream_names(js):
        return False
    await bus.provision(js, settings)
    return True


async def stream_names(js) -> set[str]:
    """Every stream's name, by ``STREAM.NAMES``: the one stream call agents may make, since it
    tells nothing about any tenant (``STREAM.INFO``'s subjects_filter would list their subjects)."""
    names: set[str] = set()
    while True:
        reply = await js._nc.request(
            f"{js._prefix}.STREAM.NAMES", json.dumps({"offset": len(names)}).encode(), timeout=js._timeout
        )
        page = json.loads(reply.data)
        if "error" in page:
            raise RuntimeError(f"STREAM.NAMES failed: {page['error']}")
        found = page.get("streams") or []
        names.update(found)
        if not found or len(names) >= page.get("total", 0):
            return names
