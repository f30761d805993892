"""A trainer worker's hold on a model: a model's steps run on one worker of the pool at a time.

The hold is the model's entry in the ``artery_trainer_leases`` KV bucket (key ``<project>.<model>``,
its value the holder), kept with JetStream's own revision checks, no lock service of ours:

- acquire: ``kv.create``, which fails while another worker holds the model;
- renew: every ``RENEW_EVERY_S``, ``kv.update(last=revision)``; a refused update means another
  worker took the model over (or the entry expired): the hold is *lost*;
- confirm: the same compare-and-set, at once, before the step's outcome becomes visible (its
  adapter saved, ``checkpoint.saved`` published): a worker that lost the hold stops there;
- release: ``kv.delete(last=revision)`` once the request has its outcome.

A holder that died stops renewing and its entry expires ``TRAINER_LEASE_TTL_S`` after its last
renewal. Sooner when the pool can tell it is gone: a worker that sees the same revision for longer
than one and a half renewals asks every ready trainer for its NATS service ping
(``$SRV.PING.artery-trainer``, ``shared.health``); when the answers include its own (the ping is
allowed and works) but not the holder's, the holder is gone, and its entry is deleted at the
revision seen (a renewal in between wins) and created anew. A worker restarted under the same
``worker_id`` takes its former life's entries over at once (the id is unique among running
workers). The compare-and-set checks, not the ping, are what keep two workers from recording
the same model's step: the ping only frees a model sooner.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass

import msgspec
import nats
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.errors import APIError, KeyNotFoundError, KeyWrongLastSequenceError

from artery.shared import subjects
from artery.shared.bus import TRAINER_LEASE_TTL_S
from artery.shared.logs import get_logger
from artery.shared.tasks import cancel_and_wait

log = get_logger(__name__)
#: A hold is renewed three times per TTL: one renewal may fail (a NATS hiccup) without losing it.
RENEW_EVERY_S = TRAINER_LEASE_TTL_S / 3
#: How long the pool's ping answers are gathered.
PING_WINDOW_S = 0.5
#: JetStream's answers to a write at a revision that is not the subject's last (``nats.js.kv``'s).
WRONG_LAST_SEQUENCE = (10071, 10164)
#: The keys this process holds now: an entry under this worker's id but not in here is a former
#: life's (two trainers of one process, as tests run them, never take each other's).
_HELD: set[str] = set()


class LeaseLost(Exception):
    """Another worker took the model over (or the hold expired) while this one worked on it."""


class Holder(msgspec.Struct, frozen=True, kw_only=True):
    """Who holds a model: the worker's id, and what its NATS service ping answers with (its
    process's ``instance`` id, ``shared.runtime.INSTANCE_ID``) so that others can tell whether it
    still runs. ``pid`` and ``metrics_url`` identify holders recorded by trainers that predate
    ``instance``; they are not unique across hosts (every container may be pid 1 on one port)."""

    worker: str
    instance: str = ""
    pid: str = ""
    metrics_url: str = ""

    def answers(self, ping: dict) -> bool:
        metadata = ping.get("metadata") or {}
        if self.instance:
            return metadata.get("instance") == self.instance
        return bool(self.pid) and (metadata.get("pid"), metadata.get("metrics_url") or "") == (
            self.pid,
            self.metrics_url,
        )


class ModelLease:
    """One model's hold, renewed in the background until released."""

    def __init__(self, kv, key: str, value: bytes, revision: int) -> None:
        self.kv, self.key, self.value, self.revision = kv, key, value, revision
        self.lost = False
        self._lock = asyncio.Lock()
        _HELD.add(key)
        self._renewer = asyncio.create_task(self._keep_renewing())

    async def confirm(self) -> None:
        """Renew now; ``LeaseLost`` when the hold is no longer this worker's."""
        async with self._lock:
            if self.lost:
                raise LeaseLost(f"the lease of {self.key} was lost")
            try:
                self.revision = await self.kv.update(self.key, self.value, last=self.revision)
            except KeyWrongLastSequenceError:
                self.lost = True
                log.warning("model lease lost", key=self.key)
                raise LeaseLost(f"the lease of {self.key} was taken over") from None

    async def release(self) -> None:
        await cancel_and_wait(self._renewer)
        _HELD.discard(self.key)
        if self.lost:
            return
        try:  # at the revision this worker wrote: a hold taken over meanwhile is left alone
            await self.kv.delete(self.key, last=self.revision)
        except Exception as exc:  # the entry expires by itself; until then this model waits
            log.warning("model lease not released", key=self.key, error=repr(exc))

    async def _keep_renewing(self) -> None:
        while not self.lost:
            await asyncio.sleep(RENEW_EVERY_S)
            try:
                await self.confirm()
            except LeaseLost:
                return
            except Exception as exc:  # an outage: two more tries before the entry can expire
                log.warning("model lease not renewed", key=self.key, error=repr(exc))


@dataclass
class Leases:
    """This worker's side of the pool: acquiring models' holds."""

    nc: nats.NATS
    holder: Holder
    _kv: object = None
    #: (key, revision) -> when this worker first saw it: a revision that outlives renewals is a
    #: holder that stopped renewing.
    _seen: dict[tuple[str, int], float] | None = None

    async def acquire(self, project: str, model: str) -> ModelLease | None:
        """The model's hold, or None while another worker holds it."""
        kv = await self._bucket()
        key = subjects.model_key(project, model)
        value = msgspec.json.encode(self.holder)
        for _ in range(2):  # a second try after taking over a dead holder's entry
            try:
                return ModelLease(kv, key, value, await kv.create(key, value))
            except KeyWrongLastSequenceError:
                pass
            try:
                entry = await kv.get(key)
            except KeyNotFoundError:  # released (or expired) in between
                continue
            if not await self._holder_gone(key, entry):
                return None
            try:
                await kv.delete(key, last=entry.revision)
            except APIError as exc:
                if exc.err_code not in WRONG_LAST_SEQUENCE:
                    raise
                return None  # it renewed after all
            log.info("model lease taken over", key=key, previous=_worker_of(entry.value))
        return None

    async def _bucket(self):
        if self._kv is None:
            self._kv = await self.nc.jetstream().key_value(subjects.TRAINER_LEASES_BUCKET)
        return self._kv

    async def _holder_gone(self, key: str, entry) -> bool:
        try:
            holder = msgspec.json.decode(entry.value or b"", type=Holder)
        except msgspec.DecodeError:
            return False  # not ours to judge: it expires
        if holder.worker == self.holder.worker:  # ids are unique among running workers
            return key not in _HELD  # a former life's entry
        seen = self._seen = self._seen if self._seen is not None else {}
        now = time.monotonic()
        first = seen.setdefault((key, entry.revision), now)
        for stale in [k for k, at in seen.items() if now - at > TRAINER_LEASE_TTL_S]:
            del seen[stale]
        if now - first < 1.5 * RENEW_EVERY_S:
            return False  # renewals may still come: the holder gets its time
        pings = await self._ping_pool()
        return any(self.holder.answers(p) for p in pings) and not any(holder.answers(p) for p in pings)

    async def _ping_pool(self) -> list[dict]:
        """Every ready trainer's ping answer, gathered for ``PING_WINDOW_S`` (none where this
        role may not ask: then no holder is judged gone, and its entry expires)."""
        answers: list[dict] = []
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox)
        try:
            await self.nc.publish(
                f"$SRV.PING.{subjects.HEALTH_SERVICE.format(service='trainer')}", b"", reply=inbox
            )
            deadline = time.monotonic() + PING_WINDOW_S
            while (left := deadline - time.monotonic()) > 0:
                try:
                    msg = await sub.next_msg(timeout=left)
                except (TimeoutError, NatsTimeoutError):
                    break
                with contextlib.suppress(ValueError):
                    answers.append(json.loads(msg.data))
        finally:
            await sub.unsubscribe()
        return answers


def _worker_of(value: bytes | None) -> str:
    try:
        return msgspec.json.decode(value or b"", type=Holder).worker
    except msgspec.DecodeError:
        return "?"
