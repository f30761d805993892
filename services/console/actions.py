"""The console's two actions: re-publish a dead letter, resume a stuck replica.

The console runs as its own read-only NATS user (``console``); it holds no credential that could
act. Whoever asks for an action gives the admin's NATS user name and password (HTTP Basic;
``ARTERY_CONSOLE_ADMIN_USER``, default ``admin``), and the console connects with them for that
one action: NATS checks the password and the user's permissions (``shared.permissions``: admin
may re-publish onto the subjects the durable consumers read and resume replicas, never pause
them). On a NATS server that checks no
credentials there is nothing to check them against: the actions are refused (403) and the console
stays read-only.

- Re-publishing (after the cause is fixed: a service upgraded, a limit raised) puts the dead
  letter's payload back on the subject it was rejected from, with its content type and ``Artery-*``
  headers and without its ``Nats-Msg-Id`` (JetStream's duplicate window would drop it); consumers
  are idempotent on the event id, so a group stored meanwhile is stored once. A payload cut to the
  dead-letter limit, or a request/reply subject (control, retention), is not re-published.
- Resuming releases the lease a replica is paused under (a trainer that died holding it would
  otherwise keep it paused until the lease runs out), then any other lease it still holds.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import os
from dataclasses import dataclass

import nats
from fastapi import HTTPException, Request

from artery.schemas import DeadLetter
from artery.shared import subjects
from artery.shared.auth import nats_connect_options
from artery.shared.codec import CONTENT_TYPE, EventDecoder
from artery.shared.control_client import registered_replicas, resume_replicas
from artery.shared.errors import ConfigError, InvalidMessage
from artery.shared.logs import get_logger
from artery.shared.permissions import REPUBLISHABLE
from artery.shared.settings import CommonSettings

log = get_logger(__name__)
_dead_letter = EventDecoder(DeadLetter)
#: Headers of the original message not carried over: JetStream's own (de-duplication, stream
#: bookkeeping) and the server's status lines.
_DROPPED_HEADERS = ("Nats-", "Status", "Description")
#: Leases released at most in one resume (a replica holds one per pauser).
_MAX_LEASES = 8
_REALM = 'Basic realm="Artery console: the NATS admin user", charset="UTF-8"'


class ActionRefused(HTTPException):
    pass


@dataclass(frozen=True)
class Credential:
    user: str
    password: str


def credential(request: Request) -> Credential:
    """The HTTP Basic credential of an action request; 401 (the browser asks) when there is none."""
    scheme, _, encoded = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "basic" and encoded:
        try:
            user, sep, password = base64.b64decode(encoded.strip(), validate=True).decode().partition(":")
        except (binascii.Error, UnicodeDecodeError):
            user, sep, password = "", "", ""
        if sep and user and password:
            return Credential(user, password)
    raise ActionRefused(
        401,
        "this action needs the NATS admin credential (HTTP Basic: user admin and its password)",
        headers={"WWW-Authenticate": _REALM},
    )


class AdminSession:
    """One NATS connection with the asker's credential, for one action; permission errors the
    server reports on it are collected (a denied publish fails asynchronously)."""

    def __init__(
        self, console_nc: nats.NATS, common: CommonSettings, who: Credential, admin_user: str = "admin"
    ) -> None:
        self.console_nc = console_nc
        self.common = common
        self.who = who
        self.admin_user = admin_user
        self.nc: nats.NATS | None = None
        self.denied: list[str] = []

    async def __aenter__(self) -> AdminSession:
        if not _checks_credentials(self.console_nc):
            raise ActionRefused(
                403,
                "read-only: this NATS server checks no credentials, so the console cannot check the "
                "admin's (run a secure stack: artery up --secure)",
            )
        if self.who.user != self.admin_user:
            # Other users may hold some of these permissions (an agent publishes its project's
            # groups), but the console's actions are the operator's.
            raise ActionRefused(403, f"only {self.admin_user!r} acts from the console, not {self.who.user!r}")
        environ = {k: v for k, v in os.environ.items() if k.startswith("ARTERY_NATS_TLS_")}
        environ.update({"ARTERY_NATS_USER": self.who.user, "ARTERY_NATS_PASSWORD": self.who.password})
        try:
            options = nats_connect_options(self.common, environ)
        except ConfigError as exc:
            raise ActionRefused(400, str(exc)) from None
        options.pop("user_credentials", None)  # the console's own, if any: not the asker's

        async def on_error(exc: Exception) -> None:
            if "permissions violation" in str(exc).lower():
                self.denied.append(str(exc))

        try:
            self.nc = await nats.connect(
                servers=[u.strip() for u in self.common.nats_url.split(",") if u.strip()],
                name=f"artery-console-action-{self.who.user}",
                allow_reconnect=False,
                max_reconnect_attempts=0,
                connect_timeout=5,
                error_cb=on_error,
                **options,
            )
        except Exception as exc:
            if "authorization" in str(exc).lower():
                raise ActionRefused(403, "NATS refused this user and password") from None
            raise ActionRefused(503, f"cannot reach NATS: {exc}") from None
        log.info("console action session", user=self.who.user)
        return self

    async def __aexit__(self, *exc) -> None:
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await self.nc.close()

    async def check_allowed(self) -> None:
        """Raise 403 when the server refused anything this session sent (after a round trip)."""
        assert self.nc is not None
        with contextlib.suppress(Exception):
            await self.nc.flush(timeout=5)
        if self.denied:
            raise ActionRefused(403, f"NATS user {self.who.user!r} may not do this: {self.denied[0]}")


def _checks_credentials(nc: nats.NATS) -> bool:
    info = getattr(nc, "_server_info", None) or {}
    return bool(info.get("auth_required"))


async def republish(session: AdminSession, seq: int) -> dict:
    """Put dead letter ``seq`` (of ``ARTERY_DLQ``) back on the subject it came from."""
    js = session.console_nc.jetstream()  # read as the console: reading needs no admin
    try:
        msg = await js.get_msg(subjects.DLQ.name, seq)
    except Exception:
        raise ActionRefused(404, f"no dead letter {seq} in {subjects.DLQ.name}") from None
    try:
        letter = _dead_letter.decode(msg.data or b"", (msg.headers or {}).get(CONTENT_TYPE))
    except InvalidMessage as exc:
        raise ActionRefused(409, f"dead letter {seq} is unreadable: {exc}") from None
    if letter.payload_truncated:
        raise ActionRefused(409, f"dead letter {seq} holds only the first bytes of the message: cut")
    if not any(subjects.covers(f, letter.subject) for f in REPUBLISHABLE):
        raise ActionRefused(
            409,
            f"{letter.subject!r} is not read by a durable consumer (a request is answered once, "
            "not replayed): send it again instead",
        )
    headers = {k: v for k, v in letter.headers.items() if not any(k.startswith(p) for p in _DROPPED_HEADERS)}
    if letter.content_type:
        headers[CONTENT_TYPE] = letter.content_type
    assert session.nc is not None
    try:
        ack = await session.nc.jetstream().publish(
            letter.subject, letter.payload, headers=headers or None, timeout=5
        )
    except Exception as exc:
        await session.check_allowed()  # a denied publish is never acknowledged: say why
        raise ActionRefused(503, f"the stream did not acknowledge the message: {exc!r}") from None
    log.info("dead letter re-published", seq=seq, subject=letter.subject, by=session.who.user)
    return {"republished": seq, "subject": letter.subject, "stream": ack.stream, "stream_seq": ack.seq}


async def resume(session: AdminSession, project: str, model: str, replica_id: str) -> dict:
    """Release every lease replica ``replica_id`` of ``project``/``model`` is paused under."""
    js = session.console_nc.jetstream()
    released: list[str] = []
    assert session.nc is not None
    for _ in range(_MAX_LEASES):
        found = await registered_replicas(js, subjects.replica_key(project, model, replica_id))
        if not found:
            raise ActionRefused(404, f"no live replica {replica_id} of {project}/{model}")
        info = found[0]
        if not info.paused or info.lease_id is None:
            break
        # A lease released already shows up again while the heartbeat catches up: releasing it
        # twice is a no-op, and the replica's answer says whether it admits requests now.
        lease = info.lease_id
        outcome = await resume_replicas(
            session.nc, project, model, lease, requested_by=f"console:{session.who.user}", timeout_s=5
        )
        ack = outcome.acked.get(replica_id)
        if ack is None:
            await session.check_allowed()
            raise ActionRefused(504, f"replica {replica_id} did not answer the resume")
        if ack.error:
            raise ActionRefused(409, f"replica {replica_id} refused the resume: {ack.error}")
        released.append(lease)
        if ack.resumed:
            break
    else:
        raise ActionRefused(409, f"replica {replica_id} is still paused after {_MAX_LEASES} leases")
    log.info("replica resumed", project=project, model=model, replica_id=replica_id, released=released)
    return {"replica_id": replica_id, "resumed": True, "released_leases": released}
