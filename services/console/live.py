"""What the console reads from NATS: model records, replicas, dead letters, and the live feed.

The feed is one core-NATS subscription per browser tab, on the subjects JetStream stores
(``train.completed``, dead letters, checkpoints, replica heartbeats): every event the services
publish is seen as it is stored, with no consumer and nothing polled.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator

import msgspec
import nats
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from artery.schemas import DeadLetter, ModelRecord
from artery.shared import subjects
from artery.shared.codec import CONTENT_TYPE, EventDecoder, json_nesting_exceeds
from artery.shared.control_client import registered_replicas
from artery.shared.errors import InvalidMessage
from artery.shared.kv import latest_values

_dead_letter = EventDecoder(DeadLetter)
_record = msgspec.json.Decoder(ModelRecord)
#: What a tab hears, by the kind of event the page gets (the SSE ``event:`` name).
FEED: dict[str, str] = {
    "train": f"{subjects.PREFIX}.train.*.>",  # requested, completed, failed
    "checkpoint": f"{subjects.PREFIX}.ckpt.*.>",
    "group": f"{subjects.PREFIX}.group.*.>",
    "dead_letter": subjects.dead_letter("*"),
    "replica": subjects.kv_updates(subjects.REPLICAS_BUCKET, ">"),
}
#: How often an idle stream says it is alive (an SSE comment), so proxies keep it open.
KEEPALIVE_S = 15.0


async def model_records(js: JetStreamContext) -> dict[tuple[str, str], ModelRecord]:
    found = {}
    try:
        values = await latest_values(js, subjects.MODELS_BUCKET, ">")
    except Exception:  # no bucket yet: nothing registered
        return {}
    for value in values.values():
        try:
            record = _record.decode(value)
        except msgspec.MsgspecError:
            continue  # an agent's garbage record: artery status names it
        found[record.project, record.name] = record
    return found


async def replicas(js: JetStreamContext) -> list[dict]:
    try:
        found = await registered_replicas(js)
    except Exception:  # no bucket yet
        return []
    return [msgspec.to_builtins(r) for r in sorted(found, key=lambda r: r.replica_id)]


async def dead_letters(js: JetStreamContext, limit: int) -> list[dict]:
    """The ``limit`` most recent dead letters, newest first, read by sequence (no consumer)."""
    try:
        info = await js.stream_info(subjects.DLQ.name)
    except Exception:
        return []
    found: list[dict] = []
    seq = info.state.last_seq
    while seq >= max(info.state.first_seq, 1) and len(found) < limit:
        try:
            msg = await js.get_msg(subjects.DLQ.name, seq)
        except Exception:  # deleted, or the stream moved on
            seq -= 1
            continue
        try:
            letter = _dead_letter.decode(msg.data or b"", (msg.headers or {}).get(CONTENT_TYPE))
            entry = msgspec.to_builtins(letter)
            entry["payload_preview"] = _preview(letter.payload)
            entry.pop("payload", None)
        except InvalidMessage as exc:
            entry = {
                "service": (msg.subject or "").rsplit(".", 1)[-1],
                "kind": "unreadable",
                "reason": str(exc),
            }
        entry["seq"] = seq
        found.append(entry)
        seq -= 1
    return found


def _preview(payload: bytes, limit: int = 400) -> str:
    try:
        text = payload.decode()
    except UnicodeDecodeError:
        text = "base64:" + base64.b64encode(payload[:limit]).decode()
    return text[:limit] + ("…" if len(text) > limit else "")


def _summary(kind: str, subject: str, data: bytes) -> dict:
    """What a tab needs from an event: its subject's project/model, and for a finished step its
    step and metrics (so the curve gains the point without asking again)."""
    out: dict = {"subject": subject}
    try:
        # Whatever an agent published passes here: nesting past the limit is not parsed (json
        # recurses once per level), and is shown by its subject alone like any other non-event.
        body = json.loads(data) if data and not json_nesting_exceeds(data) else {}
    except (ValueError, UnicodeDecodeError, RecursionError):
        body = {}  # msgpack, or not an event: the subject says enough
    if isinstance(body, dict):
        for key in ("event", "project", "model", "step", "metrics", "reason", "kind", "service", "error"):
            if key in body:
                out[key] = body[key]
        if kind == "replica":
            for key in ("replica_id", "served", "paused", "lease_id"):
                if key in body:
                    out[key] = body[key]
    return out


async def feed(nc: nats.NATS, project: str | None = None, model: str | None = None) -> AsyncIterator[str]:
    """Server-Sent Events for every event of ``project``/``model`` (all, when None), as they come."""
    queue: asyncio.Queue[tuple[str, Msg]] = asyncio.Queue(maxsize=1000)
    subs = []
    for kind, subject in FEED.items():

        async def handler(msg, kind=kind):
            if not queue.full():  # a tab that cannot keep up misses events, never the server's memory
                queue.put_nowait((kind, msg))

        subs.append(await nc.subscribe(subject, cb=handler))
    await nc.flush()
    yield "retry: 2000\n\n"
    try:
        while True:
            try:
                kind, msg = await asyncio.wait_for(queue.get(), timeout=KEEPALIVE_S)
            except TimeoutError:
                yield ": keep-alive\n\n"
                continue
            event = _summary(kind, msg.subject, msg.data)
            if project and event.get("project", project) != project:
                continue
            if model and event.get("model", model) != model:
                continue
            yield f"event: {kind}\ndata: {json.dumps(event)}\n\n"
    finally:
        for sub in subs:
            await sub.unsubscribe()
