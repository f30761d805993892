"""``artery replay``: train a fresh model on the groups another model trained on, step by step.

Every step of the source model (``training_steps``, a chosen range) is replayed through the
normal path, as the SDK's ``train()`` does it: the step's groups are published to the new
model's trajectory subject (the collector stores them), then a ``train.requested`` with the
original request's config goes to the trainer, and the replay waits for its ``train.completed``
before the next step. Nothing is sampled; no judge is asked again.

What makes a replayed step the original one:

- the groups are the stored ones, under the same ids, in the request's order; a judged group
  carries the rewards the trainer used (the judge's, with ``independent_reward`` and
  ``ruler_score`` in its metrics, as the trainer's own loading does), and a group the judge could
  not score is left out, as the trainer left it out;
- the request's config (learning rate, loss, clipping...) and, for an asynchronous step, its
  ``max_steps_off_policy``, are read from the original ``train.requested`` in the
  ``ARTERY_TRAINING`` stream (``training_steps`` keeps the group ids but not the config); for
  such a step the samples' ``served_model`` names are moved to the new model, shifted by the
  range's offset, so that staleness is counted as it was;
- the new model is registered with the source's base model, LoRA shape and chat-template
  variables, and its adapter starts from the trainer's fixed seed, as every model's does.

So a replay of the whole run (from step 1) on the same trainer settings gives the same adapter
at every step, bit for bit on the CPU (``tests/test_replay.py``). A range that starts later starts
from a fresh adapter, not from the source's step before it: it trains the base model on those
groups. Request ids are derived from the originals, so an interrupted replay run again goes on
where it stopped (a step the trainer already answered is answered again, never trained twice).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import asyncpg
import msgspec
import nats
from nats.js.errors import NotFoundError

from artery.schemas import (
    ModelRecord,
    TrainCompleted,
    TrainFailed,
    TrainRequest,
    TrainRequested,
    TrainSFTRequested,
    TrajectoryException,
    TrajectoryGroupSubmitted,
    utcnow,
)
from artery.shared import bus, subjects
from artery.shared.bus import CONTENT_TYPE
from artery.shared.codec import EventDecoder
from artery.shared.registry import read_record
from artery.shared.served_name import served_name, step_of
from artery.shared.settings import CommonSettings
from artery.shared.stored_groups import trained_trajectories

_IDS = uuid.UUID("0b7c4a52-9e1d-4d3b-8f60-7265706c6179")
_requests = EventDecoder(TrainRequest)
_outcomes = msgspec.json.Decoder(TrainCompleted | TrainFailed)


class ReplayError(Exception):
    """The replay cannot start or a step failed; the message says why."""


@dataclass(frozen=True)
class SourceStep:
    step: int
    request_id: str
    group_ids: list[str]
    metrics: dict


@dataclass(frozen=True)
class ReplayedStep:
    source_step: int
    step: int
    request_id: str
    source_metrics: dict
    metrics: dict


def replay_request_id(project: str, new_model: str, source_request_id: str) -> str:
    return bus.derived_id(_IDS, project, new_model, f"replay:{source_request_id}")


async def source_steps(
    conn: asyncpg.Connection, project: str, model: str, from_step: int | None, to_step: int | None
) -> list[SourceStep]:
    rows = await conn.fetch(
        "SELECT step, request_id, group_ids, metrics::text AS metrics FROM training_steps"
        " WHERE project = $1 AND model = $2 AND step >= $3 AND step <= $4 ORDER BY step",
        project,
        model,
        from_step or 1,
        to_step if to_step is not None else 2**31 - 1,
    )
    return [
        SourceStep(r["step"], r["request_id"], list(r["group_ids"]), msgspec.json.decode(r["metrics"]))
        for r in rows
    ]


async def original_requests(js, project: str, model: str, wanted: set[str]) -> dict[str, TrainRequest]:
    """The source's train requests by id, read from the ``ARTERY_TRAINING`` stream by subject
    (message gets: no consumer is created or left behind)."""
    subject = subjects.train("requested", project, model)
    found: dict[str, TrainRequest] = {}
    seq = 1
    while len(found) < len(wanted):
        try:
            msg = await js.get_msg(subjects.TRAINING.name, seq=seq, subject=subject, next=True)
        except NotFoundError:
            break
        seq = msg.seq + 1
        try:
            request = _requests.decode(msg.data or b"", (msg.headers or {}).get(CONTENT_TYPE))
        except Exception:  # a malformed request the trainer dead-lettered: never a step
            continue
        if request.id in wanted and request.id not in found:
            found[request.id] = request
    return found


async def load_groups(
    conn: asyncpg.Connection, project: str, model: str, group_ids: list[str]
) -> dict[str, TrajectoryGroupSubmitted]:
    """The stored groups, as the trainer saw them (``shared.stored_groups``: judged rewards in
    place, unscorable ones out), still under the source model's name."""
    groups = {
        r["id"]: r
        for r in await conn.fetch(
            "SELECT id, step, metadata::text AS metadata, metrics::text AS metrics,"
            " exceptions::text AS exceptions, logs::text AS logs FROM trajectory_groups"
            " WHERE project = $1 AND model = $2 AND id = ANY($3::text[])",
            project,
            model,
            group_ids,
        )
    }
    trajectories = await trained_trajectories(conn, project, model, group_ids)
    out = {}
    for gid, row in groups.items():
        if gid not in trajectories:
            continue  # the judge could not score it: the trainer left it out
        out[gid] = TrajectoryGroupSubmitted(
            id=gid,
            project=project,
            model=model,
            step=row["step"],
            trajectories=trajectories[gid],
            exceptions=msgspec.json.decode(row["exceptions"], type=list[TrajectoryException]),
            metadata=msgspec.json.decode(row["metadata"]),
            metrics=msgspec.json.decode(row["metrics"]),
            logs=msgspec.json.decode(row["logs"]),
            split="train",
        )
    return out


def as_new_model(
    group: TrajectoryGroupSubmitted, model: str, new_model: str, offset: int, *, off_policy: bool
) -> TrajectoryGroupSubmitted:
    """The group under the new model's name; for an asynchronous step its samples' policy steps
    are shifted by ``offset`` onto the new model, so that staleness is what it was."""
    step = None if group.step is None else max(group.step - offset, 0)
    if off_policy:
        for trajectory in group.trajectories:
            for message in trajectory.messages:
                sample = message.sample
                if sample is None:
                    continue
                sampled = step_of(sample.served_model or "", model)
                if sampled is not None:
                    sample.served_model = served_name(new_model, max(sampled - offset, 0))
    return msgspec.structs.replace(group, model=new_model, step=step)


async def register(js, source: ModelRecord, new_model: str, own_ids: set[str], conn) -> ModelRecord:
    """Register the new model like the source (base, LoRA, chat template); refuse a model that
    has trained on anything but this replay."""
    kv = await js.key_value(subjects.MODELS_BUCKET)
    found = await read_record(kv, source.project, new_model)
    trained = {
        r["request_id"]
        for r in await conn.fetch(
            "SELECT request_id FROM training_steps WHERE project = $1 AND model = $2",
            source.project,
            new_model,
        )
    }
    if trained - own_ids:
        raise ReplayError(
            f"{source.project}/{new_model} has trained {len(trained - own_ids)} steps of its own: replay"
            " into a new model name"
        )
    if found is not None and trained:
        return found.record  # an interrupted replay, going on
    record = ModelRecord(
        project=source.project,
        name=new_model,
        base_model=source.base_model,
        trainable=True,
        config={**source.config, "replayed_from": source.name},
        step=0,
        registered_at=utcnow(),
        lora=source.lora,
        chat_template_kwargs=dict(source.chat_template_kwargs),
    )
    await kv.put(subjects.model_key(source.project, new_model), msgspec.json.encode(record))
    return record


async def train_step(nc: nats.NATS, request: TrainRequest, timeout_s: float) -> TrainCompleted:
    """Publish a train request and wait for its answer (``Backend.train``'s exchange)."""
    sub = await nc.subscribe(subjects.train("*", request.project, request.model))  # before publishing
    try:
        await bus.publish_event(
            nc.jetstream(), subjects.train("requested", request.project, request.model), request
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            try:
                msg = await sub.next_msg(timeout=max(deadline - loop.time(), 0.001))
            except nats.errors.TimeoutError:
                raise ReplayError(
                    f"no answer to {request.id} within {timeout_s}s (is the trainer running?)"
                ) from None
            try:
                outcome = _outcomes.decode(msg.data)
            except msgspec.DecodeError:
                continue  # our own train.requested
            if outcome.request_id != request.id:
                continue
            if isinstance(outcome, TrainFailed):
                raise ReplayError(f"step of request {request.id} failed: {outcome.error}")
            return outcome
    finally:
        await sub.unsubscribe()


async def replay(
    settings: CommonSettings,
    database_url: str,
    project: str,
    model: str,
    new_model: str,
    *,
    from_step: int | None = None,
    to_step: int | None = None,
    timeout_s: float = 600.0,
    progress: Callable[[str], object] | None = None,
) -> list[ReplayedStep]:
    if new_model == model:
        raise ReplayError("the new model must have another name than the one replayed")
    say = progress or (lambda _: None)
    conn = await asyncpg.connect(database_url)
    try:
        nc = await bus.connect(settings, name="artery-replay", max_reconnect_attempts=3)
    except BaseException:
        await conn.close()
        raise
    try:
        js = nc.jetstream()
        found = await read_record(await js.key_value(subjects.MODELS_BUCKET), project, model)
        if found is None or not found.record.base_model:
            raise ReplayError(f"{project}/{model} is not a registered trainable model")
        steps = await source_steps(conn, project, model, from_step, to_step)
        if not steps:
            raise ReplayError(
                f"{project}/{model} has no recorded steps in [{from_step or 1}, {to_step or 'end'}]"
            )
        requests = await original_requests(js, project, model, {s.request_id for s in steps})
        missing = [s.step for s in steps if s.request_id not in requests]
        if missing:
            raise ReplayError(
                f"the train requests of steps {missing} are no longer in the {subjects.TRAINING.name}"
                " stream (their configs are kept only there)"
            )
        own = {replay_request_id(project, new_model, s.request_id): s for s in steps}
        await register(js, found.record, new_model, set(own), conn)
        offset = steps[0].step - 1
        replayed = []
        for source in steps:
            original = requests[source.request_id]
            off_policy = isinstance(original, TrainRequested) and original.max_steps_off_policy is not None
            groups = await load_groups(conn, project, model, source.group_ids)
            kept = [gid for gid in source.group_ids if gid in groups]
            if not kept:
                raise ReplayError(f"step {source.step}: none of its groups could be trained on")
            await bus.publish_until_acked(
                js,
                [
                    bus.prepare(
                        subjects.trajectories(project, new_model),
                        as_new_model(groups[gid], model, new_model, offset, off_policy=off_policy),
                    )
                    for gid in dict.fromkeys(kept)
                ],
            )
            request_id = replay_request_id(project, new_model, source.request_id)
            step = source.step - 1 - offset
            request: TrainRequest = (
                TrainSFTRequested(
                    id=request_id,
                    project=project,
                    model=new_model,
                    step=step,
                    group_ids=kept,
                    config=original.config,
                )
                if isinstance(original, TrainSFTRequested)
                else TrainRequested(
                    id=request_id,
                    project=project,
                    model=new_model,
                    step=step,
                    group_ids=kept,
                    config=original.config,
                    max_steps_off_policy=original.max_steps_off_policy,
                )
            )
            outcome = await train_step(nc, request, timeout_s)
            if outcome.step is None:  # a completed step always names the version it made
                raise ReplayError(f"step of request {request_id} completed without its step number")
            replayed.append(
                ReplayedStep(source.step, outcome.step, request_id, source.metrics, outcome.metrics)
            )
            say(
                f"step {source.step} -> {served_name(new_model, outcome.step)}:"
                f" loss {outcome.metrics.get('loss')} (was {source.metrics.get('loss')})"
            )
        return replayed
    finally:
        await bus.close(nc)
        await conn.close()
