"""The trainer: a train request in, one GRPO (or SFT) step on the LoRA adapter, a checkpoint out.

Two requests arrive on ``artery.train.requested.<project>.<model>``: ``train.requested`` (a GRPO
step over scored groups) and ``train.sft_requested`` (supervised fine-tuning on the groups'
trajectories, ART's ``train_sft``). Both take the same path and get the same answers.

Around every step: wait until the request's groups are stored, pause every inference replica of
the model (a lease, renewed while training), train, save the adapter and the optimizer state,
publish ``checkpoint.saved``, record the step, advance the model's step in the registry, resume
inference, and answer with ``train.completed`` (what a step announces is in ``announce.py``). A
redelivered request is answered from the record (or from the checkpoint it already produced) and
never trains twice; a trainer that dies mid-step leaves inference paused no longer than the lease.

Tracing: each request is handled in a ``trainer.step`` span, the child of the span that published
``train.requested`` (the SDK's ``train()``), with a link to every group's submission (the
``Artery-Trace-Links`` header); ``checkpoint.saved`` and ``train.completed`` carry the step's context.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Sequence
from pathlib import Path

import msgspec
import nats
from nats.aio.msg import Msg
from opentelemetry import trace

from artery.schemas import (
    ModelRecord,
    TrainCompleted,
    TrainFailed,
    TrainRequest,
    TrainRequested,
    TrainSFTRequested,
)
from artery.services.trainer import announce, checkpoints
from artery.services.trainer.announce import request_event_id as request_event_id  # tests name it here
from artery.services.trainer.settings import TrainerSettings
from artery.services.trainer.staleness import drop_stale
from artery.services.trainer.store import completed_step, load_groups, record_step, stored_group_ids
from artery.shared import subjects
from artery.shared.bus import CONTENT_TYPE
from artery.shared.codec import EventDecoder
from artery.shared.consumer import ConsumerOptions, ConsumingService, DurableConsumer
from artery.shared.control_client import PauseFailed, paused
from artery.shared.db import ServicePool
from artery.shared.errors import DependencyUnavailable, InvalidMessage
from artery.shared.logs import get_logger
from artery.shared.registry import read_record
from artery.shared.tracing import continue_trace, extract_links, tracer
from artery.shared.wakeup import woken_by

log = get_logger(__name__)
SERVICE = "trainer"
TRAINER_CONSUMER = "trainer"
#: A request waiting for its groups reads PostgreSQL again at least this often (see woken_by).
GROUP_RECHECK_S = 2.0
_decoder = EventDecoder(TrainRequest)


@contextlib.asynccontextmanager
async def keep_alive(msg: Msg, ack_wait_s: float):
    """Tell JetStream the request is still being worked on, three times per ack wait, so that a
    short ack wait (a crashed trainer's request comes back soon) does not redeliver a long step."""

    async def beat() -> None:
        while True:
            await asyncio.sleep(max(0.5, ack_wait_s / 3))
            with contextlib.suppress(Exception):  # a lost heartbeat only risks a redelivery
                await msg.in_progress()

    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


class GroupsNotStored(Exception):
    pass


class Trainer(ConsumingService):
    def __init__(self, nc: nats.NATS, dsn: str, settings: TrainerSettings, *, trainer_id: str = SERVICE):
        self.nc = nc
        self.js = nc.jetstream()
        self.settings = settings
        self.trainer_id = trainer_id
        # Opened at start; an outage later is waited out (nak, back off), never a failure of the
        # request, which would dead-letter it as poison in the end.
        self.db = ServicePool(dsn, max_size=2)
        self.policies = checkpoints.PolicyCache(settings)
        self._tracer = tracer(SERVICE)
        self.consumers = [
            DurableConsumer(
                self.js,
                service=SERVICE,
                stream=subjects.TRAINING,
                durable=TRAINER_CONSUMER,
                filter_subject=subjects.train("requested", "*", "*"),
                handler=self.handle_batch,
                options=ConsumerOptions(batch_size=1, ack_wait_s=settings.ack_wait_s, fetch_timeout_s=0.5),
            )
        ]

    async def start(self) -> None:
        await self.db.open()
        await super().start()

    async def handle_batch(self, msgs: Sequence[Msg]) -> list[BaseException | None]:
        outcomes: list[BaseException | None] = []
        for msg in msgs:
            try:
                request = _decoder.decode(msg.data, (msg.headers or {}).get(CONTENT_TYPE))
                non_finite = [
                    name
                    for name, value in msgspec.structs.asdict(request.config).items()
                    if any(
                        isinstance(v, float) and not math.isfinite(v)
                        for v in (value if isinstance(value, list) else [value])
                    )
                ]
                if non_finite:  # msgpack carries NaN and infinities, which JSON Schema cannot forbid
                    raise InvalidMessage(
                        "non_finite", f"config {', '.join(non_finite)} must be finite", original_id=request.id
                    )
                # NATS permissions scope an agent to its project's subjects: the payload must not
                # name another project's model, or an agent could train (and pause) someone else's.
                if msg.subject != subjects.train("requested", request.project, request.model):
                    raise InvalidMessage(
                        "subject_mismatch",
                        f"{request.project}/{request.model} requested on {msg.subject}",
                        original_id=request.id,
                    )
                with continue_trace(
                    self._tracer,
                    "trainer.step",
                    msg.headers,
                    attributes={
                        "artery.project": request.project,
                        "artery.model": request.model,
                        "artery.request_id": request.id,
                        "artery.groups": len(request.group_ids),
                        "artery.kind": "sft" if isinstance(request, TrainSFTRequested) else "grpo",
                    },
                    links=extract_links(msg.headers),
                ):
                    async with keep_alive(msg, self.settings.ack_wait_s):
                        await self.handle(request)
                outcomes.append(None)
            except (InvalidMessage, DependencyUnavailable) as exc:
                outcomes.append(exc)
            except PauseFailed as exc:
                # A replica that died stays registered until its heartbeat expires (30 s): an outage
                # to wait out with back-off, never a reason to dead-letter the request.
                outcomes.append(DependencyUnavailable(f"inference did not pause: {exc}"))
        return outcomes

    async def handle(self, request: TrainRequest) -> TrainCompleted | TrainFailed:
        async with self.db.connection() as conn:
            done = await completed_step(conn, request.project, request.model, request.id)
        if done is not None:  # a redelivery: answer again, train nothing
            step, metrics, group_ids = done
            if group_ids != list(request.group_ids):  # another request under a used id
                raise InvalidMessage(
                    "conflict",
                    f"request {request.id!r} already trained step {step} on other groups"
                    f" ({len(group_ids)} of them)",
                    original_id=request.id,
                )
            # A crash between recording the step and advancing the registry left it behind.
            await announce.advance_registry(self.js, request, step)
            return await announce.complete(self.js, request, step, metrics)
        record = await self._model_record(request)
        try:
            groups = await self._wait_for_groups(request)
        except GroupsNotStored as exc:
            return await announce.fail(self.js, request, str(exc), retriable=True)
        if isinstance(request, TrainSFTRequested):
            try:  # a schedule of learning rates must have one per batch: never trainable as sent
                request.config.learning_rates(sum(len(g) for g in groups))
            except ValueError as exc:
                return await announce.fail(self.js, request, str(exc), retriable=False)
        try:
            return await self._train(request, record, groups)
        except checkpoints.ModelUnusable as exc:  # asking again cannot help: the agent must hear why
            return await announce.fail(self.js, request, str(exc), retriable=False)

    async def _model_record(self, request: TrainRequest) -> ModelRecord:
        found = await read_record(
            await self.js.key_value(subjects.MODELS_BUCKET), request.project, request.model
        )
        if found is None:  # never registered, or its record is not valid (an agent writes it)
            raise InvalidMessage(
                "unknown_model",
                f"{request.project}/{request.model} is not registered (or its record is not valid)",
                original_id=request.id,
            )
        record = found.record
        if not record.trainable or not record.base_model:
            raise InvalidMessage(
                "not_trainable",
                f"{request.project}/{request.model} has no base model",
                original_id=request.id,
            )
        return record

    async def _wait_for_groups(self, request: TrainRequest) -> list:
        """Groups are published just before the request; the collector may still be writing them
        (and the reward service judging them). Woken by their ``group.ready``/``group.scored``."""
        deadline = time.monotonic() + self.settings.group_wait_s
        wanted = set(request.group_ids)
        signals = (
            subjects.group_ready(request.project, request.model),
            subjects.group_scored(request.project, request.model),
        )
        async with woken_by(self.nc, *signals) as wake:
            while True:
                wake.clear()  # before reading: a group stored during the read wakes the next wait
                async with self.db.connection() as conn:
                    ready = await stored_group_ids(conn, request.project, request.model, request.group_ids)
                    missing = wanted - ready
                    if not missing:
                        return await load_groups(conn, request.project, request.model, request.group_ids)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise GroupsNotStored(
                        f"{len(missing)} of {len(wanted)} groups were never stored: {sorted(missing)[:5]}"
                    )
                # (keep_alive tells JetStream we are still at it.) The timeout only covers a signal
                # missed while reconnecting.
                await wake.wait(min(remaining, GROUP_RECHECK_S))

    async def _train(self, request: TrainRequest, record: ModelRecord, groups: list) -> TrainCompleted:
        started = time.monotonic()
        policy, step = await self.policies.get(record)
        already = checkpoints.step_for_request(self.settings, record, request.id)
        if already is not None:  # crashed after saving, before recording: publish what was saved
            new_step, metrics = already
        else:
            async with self._hold_inference(request) as lease:
                pause_s = time.monotonic() - started
                result, extra = await self._step(policy, step, request, record, groups)
                new_step = step + 1
                save_started = time.monotonic()
                await asyncio.to_thread(
                    checkpoints.save_step, self.settings, record, policy, new_step, request.id, result.metrics
                )
                metrics = {
                    **result.metrics,
                    **extra,
                    "trained": float(result.trained),
                    "pause_s": pause_s,
                    "save_s": time.monotonic() - save_started,
                    "replicas_paused": float(len(lease.outcome.acked)) if lease is not None else 0.0,
                }
            self.policies.advance(record, new_step)
        await announce.publish_checkpoint(self.js, self.settings, request, record, new_step, metrics)
        async with self.db.connection() as conn:
            await record_step(
                conn,
                request_id=request.id,
                project=request.project,
                model=request.model,
                step=new_step,
                group_ids=request.group_ids,
                trained=bool(metrics.get("trained", 1.0)),
                metrics=metrics,
            )
        await announce.advance_registry(self.js, request, new_step)
        metrics["step_total_s"] = time.monotonic() - started
        announce.observe(metrics)
        span = trace.get_current_span()
        span.set_attribute("artery.step", new_step)
        for key in ("loss", "reward_mean", "trained"):
            if isinstance(metrics.get(key), int | float) and math.isfinite(metrics[key]):
                span.set_attribute(f"artery.{key}", float(metrics[key]))
        log.info(
            "trained",
            project=request.project,
            model=request.model,
            step=new_step,
            loss=metrics.get("loss"),
            reward_mean=metrics.get("reward_mean"),
        )
        return await announce.complete(self.js, request, new_step, metrics)

    def _hold_inference(self, request: TrainRequest):
        """A synchronous step pauses every replica while it trains (an async context yielding the
        lease); an asynchronous one (off-policy samples allowed) trains while inference keeps
        serving the previous step, and the adapter swap afterwards is the only pause (None)."""
        if is_off_policy(request):
            return contextlib.nullcontext(None)
        return paused(
            self.nc,
            request.project,
            request.model,
            self.settings.pause_lease_s,
            requested_by=self.trainer_id,
            timeout_s=self.settings.pause_timeout_s,
        )

    async def _step(
        self, policy, step: int, request: TrainRequest, record: ModelRecord, groups: list
    ) -> tuple:
        """The optimizer work of one request, in a thread; returns its result and extra metrics.

        Prompts are rendered with the model's ``chat_template_kwargs``, the ones the SDK sends
        with every completion request: inference rendered the sampled turns' prompts with them."""
        template = record.chat_template_kwargs
        if isinstance(request, TrainSFTRequested):
            trajectories = [t for group in groups for t in group]
            result = await asyncio.to_thread(
                policy.sft_step,
                trajectories,
                request.config,
                max_seq_len=self.settings.max_seq_len,
                chat_template_kwargs=template,
            )
            return result, {}
        extra: dict[str, float] = {}
        off_policy = is_off_policy(request)
        if off_policy:  # samples older than the request allows are dropped, and counted
            groups, report = drop_stale(
                groups,
                model=request.model,
                current_step=step,
                max_steps_off_policy=request.max_steps_off_policy,
            )
            extra = report.metrics()
        result = await asyncio.to_thread(
            policy.train_step,
            groups,
            request.config,
            max_seq_len=self.settings.max_seq_len,
            temperature=self.settings.temperature,
            off_policy=off_policy,
            chat_template_kwargs=template,
        )
        return result, extra


def is_off_policy(request: TrainRequest) -> bool:
    """Asynchronous mode: the GRPO request names how stale its samples may be."""
    return isinstance(request, TrainRequested) and request.max_steps_off_policy is not None


def model_dir(settings: TrainerSettings, project: str, model: str) -> Path:
    return Path(settings.checkpoint_dir) / project / model
