"""What a training step tells the world: ``checkpoint.saved``, the model's step in the registry,
``train.completed`` or ``train.failed``, and the step's figures on ``/metrics``.

A saved step leaves this host through the trainer-state store (``shared.trainer_state``), never a
shared disk: ``checkpoint.saved`` names the adapter there, where the publisher, a replica and any
other trainer worker read it.

Every event a request causes has an id derived from the request's, so a redelivered request
publishes the same events again and JetStream drops the repeats.
"""

from __future__ import annotations

import asyncio
import math
import uuid
from typing import Any

import msgspec
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from artery.schemas import (
    CheckpointSaved,
    CheckpointStaged,
    ModelRecord,
    TrainCompleted,
    TrainFailed,
    TrainRequest,
)
from artery.services.trainer import step_files
from artery.shared import subjects, trainer_state
from artery.shared.adapters import sha256_hex
from artery.shared.bus import derived_id, event_headers, publish_event
from artery.shared.codec import encode
from artery.shared.errors import DependencyUnavailable
from artery.shared.logs import get_logger
from artery.shared.metrics import PAUSE_SECONDS, STEP_SECONDS, TRAINER_TOKENS, TRAINER_TOKENS_PER_SECOND
from artery.shared.registry import read_record
from artery.shared.served_name import served_name

log = get_logger(__name__)
_IDS = uuid.UUID("5b2d8f0e-6a1c-4f4e-9d55-747261696e21")
#: Steps of a model whose state stays in the trainer-state store: the newest is what any worker
#: resumes from; the two before it cover a step saved but never recorded (a crash in between).
KEEP_STATE_STEPS = 3
#: Steps of a model whose adapter stays there (at least those whose state does: a state names its
#: adapter, stored beside it): the publisher reads each one from the store, and a
#: publisher that was away while more steps than this were trained finds the older ones gone
#: (dead-lettered, ``not_found``; the newest is published). ``train()`` waits until each step is
#: served, so in practice the publisher is a step behind at most.
KEEP_ADAPTER_STEPS = 10
assert KEEP_ADAPTER_STEPS >= KEEP_STATE_STEPS


def request_event_id(kind: str, request: TrainRequest) -> str:
    """Ids of the events a request causes, the same on every redelivery (JetStream de-dupes) and
    scoped to the request's model: another project's request under the same id causes others
    (the publisher keys checkpoints on the ``checkpoint.saved`` id)."""
    return derived_id(_IDS, request.project, request.model, f"{kind}:{request.id}")


def finite(metrics: dict) -> dict[str, float]:
    """Numeric metrics that JSON can carry: a NaN loss (a skipped, non-finite step) is left out."""
    return {k: float(v) for k, v in metrics.items() if isinstance(v, int | float) and math.isfinite(v)}


async def publish_checkpoint(
    js: JetStreamContext,
    request: TrainRequest,
    record: ModelRecord,
    step: int,
    metrics: dict,
    files: step_files.StepFiles,
) -> None:
    """Upload the saved step (its adapter and its state) to the trainer-state store and announce
    ``checkpoint.saved`` naming the adapter there (the publisher stores and announces it). A
    redelivered request uploads the same bytes again, which the store finds already there. The
    model's older steps are pruned later (``prune_stored_steps``), once the step is answered.

    The adapter goes first, and ``checkpoint.staged`` says so: replicas fetch and unpack it while
    the state (twice the adapter's size, for AdamW's two moments) is packed and stored, and serve
    it as soon as ``checkpoint.saved`` follows. The state names the adapter by its digest instead
    of holding it: a step's adapter is uploaded once."""
    if record.base_model is None:  # never: the trainer refuses such a record before a step
        raise ValueError(f"a record of project {record.project} has no base model")
    project, model = request.project, request.model
    adapter = files.adapter_tar
    name = trainer_state.object_name(project, model, step, trainer_state.ADAPTER)
    sha256 = await asyncio.to_thread(sha256_hex, adapter)  # once: for the store and the announcements
    await trainer_state.put(js, name, adapter, sha256=sha256)
    # What both announcements say of the adapter; the hint comes first, while the state is stored.
    adapter_fields: dict[str, Any] = {
        "project": project,
        "model": model,
        "step": step,
        "uri": trainer_state.uri(name),
        "sha256": sha256,
        "size_bytes": len(adapter),
        "base_model": record.base_model,
    }
    await stage(js, CheckpointStaged(id=request_event_id("staged", request), **adapter_fields))
    # Both stored before the announcement: a worker resuming this model after a crash finds the
    # state of every step announced (a step trained again would be announced under the same id).
    state = await asyncio.to_thread(files.state_tar, sha256)
    await trainer_state.put(js, trainer_state.object_name(project, model, step, trainer_state.STATE), state)
    del state
    saved = CheckpointSaved(id=request_event_id("saved", request), metrics=finite(metrics), **adapter_fields)
    await publish_event(js, subjects.checkpoint("saved", project, model), saved)


async def stage(js: JetStreamContext, staged: CheckpointStaged) -> None:
    """Publish the hint on core NATS, not waiting for anyone: a hint that does not go out costs
    the replicas their head start, never the step."""
    try:
        subject = subjects.checkpoint_staged(staged.project, staged.model)
        await js._nc.publish(subject, encode(staged), headers=event_headers(staged))
    except Exception as exc:
        log.warning("checkpoint.staged not sent; replicas fetch on checkpoint.saved", error=repr(exc))


async def prune_stored_steps(js: JetStreamContext, project: str, model: str, newest: int) -> None:
    """Housekeeping after a step is answered (off the path of a ``train()`` waiting for it: the
    store's listing and deletions are round trips): a failure is logged, and the next step prunes
    again."""
    try:
        for kind, keep in (
            (trainer_state.STATE, KEEP_STATE_STEPS),
            (trainer_state.ADAPTER, KEEP_ADAPTER_STEPS),
        ):
            pruned = await trainer_state.prune(js, project, model, newest, kind, keep)
            if pruned:
                log.info(
                    "older steps pruned from the store", project=project, model=model, kind=kind, steps=pruned
                )
    except DependencyUnavailable as exc:
        log.warning("pruning the trainer-state store failed; the next step tries again", error=str(exc))


async def advance_registry(kv: KeyValue, request: TrainRequest, step: int) -> None:
    """The model's step in the registry, compare-and-set so a concurrent register keeps its fields."""
    key = subjects.model_key(request.project, request.model)
    for _ in range(10):
        found = await read_record(kv, request.project, request.model)
        if found is None:  # deleted or overwritten with garbage since: nothing to advance
            return
        if found.record.step >= step:
            return
        try:
            await kv.update(
                key,
                msgspec.json.encode(msgspec.structs.replace(found.record, step=step)),
                found.revision,
            )
            return
        except Exception:  # someone wrote in between: read again
            await asyncio.sleep(0.05)
    raise DependencyUnavailable("could not advance the model's step in the registry")


async def complete(js: JetStreamContext, request: TrainRequest, step: int, metrics: dict) -> TrainCompleted:
    """``train.completed``: the request's answer (the same id on every redelivery)."""
    event = TrainCompleted(
        id=request_event_id("completed", request),
        project=request.project,
        model=request.model,
        step=step,
        request_id=request.id,
        metrics=finite(metrics),
        checkpoint=served_name(request.model, step),
    )
    await publish_event(js, subjects.train("completed", request.project, request.model), event)
    return event


async def fail(js: JetStreamContext, request: TrainRequest, error: str, *, retriable: bool) -> TrainFailed:
    """``train.failed``: ``retriable`` says whether asking again can help."""
    log.warning("train request failed", request_id=request.id, error=error)
    event = TrainFailed(
        id=request_event_id("failed", request),
        project=request.project,
        model=request.model,
        request_id=request.id,
        error=error,
        retriable=retriable,
    )
    await publish_event(js, subjects.train("failed", request.project, request.model), event)
    return event


def observe(metrics: dict[str, float]) -> None:
    """A finished step's figures for ``/metrics``."""
    STEP_SECONDS.observe(metrics["step_total_s"])
    if "pause_s" in metrics:
        PAUSE_SECONDS.labels("trainer").observe(metrics["pause_s"])
    tokens, seconds = metrics.get("tokens_trained"), metrics.get("step_time_s")
    if isinstance(tokens, int | float) and math.isfinite(tokens):
        TRAINER_TOKENS.inc(tokens)
        if isinstance(seconds, int | float) and seconds > 0:
            TRAINER_TOKENS_PER_SECOND.set(tokens / seconds)
