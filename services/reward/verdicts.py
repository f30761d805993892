"""Paid-for verdicts, kept in a JetStream KV bucket from the moment the judge answers.

A RULER verdict costs money and time (the judge is usually a frontier model), so once it has been
given it must never be asked for again — not after PostgreSQL refused the row, not after a NATS
redelivery, not after a SIGKILL between the answer and the row. The verdict is put here first,
before anything else can fail; every delivery looks here before it calls the judge. The row in
PostgreSQL stays the record (and the trainer's source); entries here expire after
``bus.VERDICT_TTL_S``, long after any row was written.

Keys are ``<project>.<model>.<digest of the group id>``: group ids are free text chosen by agents
(KV keys are not), and the project and model in front keep one tenant's verdict out of reach of
another's group that happens to use the same id.
"""

from __future__ import annotations

import hashlib

import msgspec
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

from artery.services.reward.store import Verdict
from artery.shared import subjects
from artery.shared.errors import DependencyUnavailable


class JudgedGroup(msgspec.Struct, frozen=True):
    """What the judge said about one group, and the rubric it was asked with."""

    verdict: Verdict
    rubric: str | None


_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder(JudgedGroup).decode


def verdict_key(project: str, model: str, group_id: str) -> str:
    digest = hashlib.sha256(group_id.encode()).hexdigest()[:32]
    return f"{subjects.model_key(project, model)}.{digest}"


class VerdictOutbox:
    """The reward service's KV bucket of verdicts, opened at first use. NATS failing to answer is
    ``DependencyUnavailable`` (retried later), as PostgreSQL's is in ``ServicePool``."""

    def __init__(self, js: JetStreamContext):
        self.js = js
        self._kv: KeyValue | None = None

    async def _bucket(self) -> KeyValue:
        if self._kv is None:
            self._kv = await self.js.key_value(subjects.VERDICTS_BUCKET)
        return self._kv

    async def get(self, project: str, model: str, group_id: str) -> JudgedGroup | None:
        try:
            entry = await (await self._bucket()).get(verdict_key(project, model, group_id))
        except KeyNotFoundError:
            return None
        except Exception as exc:
            raise DependencyUnavailable(f"verdict outbox unavailable: {exc!r}") from exc
        return _decode(entry.value) if entry.value is not None else None  # put always writes one

    async def put(self, project: str, model: str, group_id: str, judged: JudgedGroup) -> None:
        try:
            await (await self._bucket()).put(verdict_key(project, model, group_id), _encode(judged))
        except Exception as exc:
            raise DependencyUnavailable(f"verdict outbox unavailable: {exc!r}") from exc
