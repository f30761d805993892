"""The trainer: a train request in, one GRPO (or SFT) step on the LoRA adapter, a checkpoint out.

Two requests arrive on ``artery.train.requested.<project>.<model>``: ``train.requested`` (a GRPO
step over scored groups) and ``train.sft_requested`` (supervised fine-tuning on the groups'
trajectories, ART's ``train_sft``). Both take the same path and get the same answers.

Which request runs next is ``schedule.py``'s: round-robin over projects among the pending requests
whose groups are stored; one whose groups are not stored yet is handed back to wait (never
occupying the trainer), up to ``group_wait_s``. What a request may cost is ``budgets.py``'s, and
which base weights a model may name is ``base_models.py``'s: both refuse before anything is loaded,
with ``train.failed`` (not retriable). So does every error of the step itself (a model that cannot
be loaded, a request that cannot be trained): the same request meets it again on every delivery.

Around every step: pause every inference replica of
the model (a lease, renewed while training), train, resume inference while the adapter and the
optimizer state are saved, publish ``checkpoint.saved``, record the step, advance the model's step
in the registry, answer with ``train.completed``, then prune the model's older steps from the
trainer-state store (what a step announces is in ``announce.py``). A
redelivered request is answered from the record (or from the checkpoint it already produced) and
never trains twice; a trainer that dies mid-step leaves inference paused no longer than the lease.

Any number of trainer processes may share the requests (a pool of workers): the chosen request
runs holding its model's lease (``lease.py``), so a model's steps run on one worker at a time while
other models train on the others; a request whose model another worker holds is handed back for
``LEASED_RECHECK_S``. The lease is confirmed (compare-and-set) before the step is saved and again
before it is announced: a worker that lost it (another took the model over) drops the step there
and hands the request back, for the holder.

Tracing: each request is handled in a ``trainer.step`` span, the child of the span that published
``train.requested`` (the SDK's ``train()``), with a link to every group's submission (the
``Artery-Trace-Links`` header); ``checkpoint.saved`` and ``train.completed`` carry the step's context.

Long module: one request's life from delivery to outcome, whose order is the guarantee (nothing is
loaded before the budgets, inference is paused only for a request that can train); the rules it
applies live beside it in schedule.py, budgets.py, base_models.py and announce.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import msgspec
import nats
from nats.aio.msg import Msg
from nats.js.kv import KeyValue
from opentelemetry import trace

from artery.schemas import (
    ModelRecord,
    TrainCompleted,
    TrainConfig,
    TrainFailed,
    TrainRequest,
    TrainRequested,
    TrainSFTRequested,
)
from artery.services.trainer import announce, checkpoints, step_files
from artery.services.trainer.announce import request_event_id as request_event_id  # tests name it here
from artery.services.trainer.base_models import BaseModelRefused, check_base_model
from artery.services.trainer.budgets import (
    BudgetExceeded,
    StepBudget,
    check_group_count,
    check_stored_bytes,
    check_trajectories,
    memory_limit_bytes,
)
from artery.services.trainer.distributed import train_over_processes
from artery.services.trainer.lease import Holder, LeaseLost, Leases, ModelLease
from artery.services.trainer.policy import StepCancelled, StepResult
from artery.services.trainer.schedule import (
    FIRST_RECHECK_S,
    Deferred,
    DeferringConsumer,
    Later,
    RoundRobin,
    recheck_delay,
)
from artery.services.trainer.settings import TrainerSettings, worker_id
from artery.services.trainer.staleness import drop_stale
from artery.services.trainer.store import (
    completed_step,
    load_groups,
    record_step,
    stored_bytes,
    stored_group_ids,
)
from artery.shared import subjects
from artery.shared.consumer import ConsumerOptions, ConsumingService
from artery.shared.control_client import PauseFailed, paused
from artery.shared.db import ServicePool
from artery.shared.errors import DependencyUnavailable, InvalidMessage
from artery.shared.logs import get_logger
from artery.shared.registry import read_record
from artery.shared.subscriber import Attributes, Delivery, Subscriber
from artery.shared.tasks import cancel_and_wait, settled
from artery.shared.wakeup import Wakeup

log = get_logger(__name__)
SERVICE = "trainer"
#: What says a group is stored (and judged, where it is): the news a waiting request wakes on.
GROUP_NEWS = (subjects.group_ready, subjects.group_scored)
TRAINER_CONSUMER = "trainer"
#: A request whose model another worker of the pool is training is looked at again this soon.
LEASED_RECHECK_S = 0.5
#: A request this worker cannot train (it lacks the model's newest step) is offered again this soon.
STALE_RECHECK_S = 2.0


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
        await cancel_and_wait(task)


class GroupsNotStored(Exception):
    pass


class StepRefused(Exception):
    """Loading the model or computing the step failed in a way the same request meets again on
    every delivery (``checkpoints.ModelUnusable`` and ``BudgetExceeded`` are ValueErrors, like
    the checks of the loss settings; an OSError there is base weights that cannot be read; torch
    reports what a batch cannot do, its device's memory included, as RuntimeErrors)."""


#: Errors of the model's loading and of the step's computation that refuse the request for good:
#: redelivered, the same request on the same model and settings meets them again.
REFUSED = (ValueError, OSError, RuntimeError)


class Trainer(ConsumingService):
    def __init__(self, nc: nats.NATS, dsn: str, settings: TrainerSettings, *, holder: Holder | None = None):
        self.nc = nc
        self.js = nc.jetstream()
        self._models_kv: KeyValue | None = None  # the registry's bucket, looked up at first use
        self.settings = settings
        # This worker in the pool: what its models' leases name (and its pauses).
        self.holder = holder or Holder(worker=worker_id(settings))
        self.trainer_id = self.holder.worker
        self.leases = Leases(nc, self.holder)
        # Opened at start; an outage later is waited out (nak, back off), never a failure of the
        # request, which would dead-letter it as poison in the end.
        self.db = ServicePool(dsn, max_size=2)
        # Resumes a model from the newest step any worker of the pool saved (the trainer-state store).
        self.policies = checkpoints.PolicyCache(settings, self.js)
        self.groups_heard = Wakeup("trainer_groups")
        self._awaited: set[str] = set()  # the group subjects of the requests in hand now
        self.subscriber: Subscriber[TrainRequest] = Subscriber(
            TrainRequest,
            service=SERVICE,
            span="trainer.step",
            # NATS permissions scope an agent to its project's subjects: the payload must not
            # name another project's model, or an agent could train (and pause) someone else's.
            subject=lambda request: subjects.train("requested", request.project, request.model),
            sent_as="requested",
            check=check_finite_config,
            attributes=step_attributes,
            links=True,  # to every group's submission
        )
        self.budget = StepBudget(settings, memory_limit_bytes(settings, settings.device))
        self.round_robin = RoundRobin()
        # Set by stop(): the step running in its thread gives up between micro-batches.
        self.stopping = threading.Event()
        self.requests = DeferringConsumer(
            self.js,
            service=SERVICE,
            stream=subjects.TRAINING,
            durable=TRAINER_CONSUMER,
            filter_subject=subjects.train("requested", "*", "*"),
            handler=self.subscriber.batched(self.handle_batch, keep=_as_sent),
            options=ConsumerOptions(
                batch_size=settings.schedule_window, ack_wait_s=settings.ack_wait_s, fetch_timeout_s=0.5
            ),
        )
        self.consumers = [self.requests]

    async def start(self) -> None:
        await self.db.open()
        # The SDK publishes a request right behind its groups, so a request often arrives a few
        # ms before the collector has stored them: the news of a stored (or judged) group of a
        # waiting request's model wakes the check again, instead of a hand-back on a timer.
        for news in GROUP_NEWS:
            await self.nc.subscribe(news("*", "*"), cb=self._on_group)
        await self.nc.flush()
        await super().start()

    async def _on_group(self, msg: Msg) -> None:
        if msg.subject in self._awaited:
            self.groups_heard.heard(msg)

    def stop(self) -> None:
        self.stopping.set()
        super().stop()

    async def close(self) -> None:
        self.policies.thread.close()
        await super().close()

    async def handle_batch(self, items: list[tuple[TrainRequest, Delivery]]) -> list[BaseException | None]:
        """Up to ``schedule_window`` pending requests, decoded and checked by the subscriber: hand
        back those still waiting for groups, run one of the ready ones (``schedule.py``) whose
        model this worker can lease (``lease.py``), hand back the rest: those of models another
        worker holds come back after ``LEASED_RECHECK_S``."""
        outcomes: list[BaseException | None] = [None] * len(items)
        ready: list[int] = []
        waiting: Counter[str] = Counter()  # per project, to spread its waiting requests out
        self._awaited = {news(r.project, r.model) for r, _ in items for news in GROUP_NEWS}
        self.groups_heard.clear()
        for index, (request, ctx) in enumerate(items):
            try:
                if await self._waits_for_groups(ctx.msg, request):
                    delay = recheck_delay(
                        _age_s(ctx.msg), self.settings.group_wait_s, waiting[request.project]
                    )
                    waiting[request.project] += 1
                    outcomes[index] = Deferred("groups not stored yet", delay)
                else:
                    ready.append(index)
            except Exception as exc:  # this message's own outcome, whatever it is (errors.py)
                outcomes[index] = exc
        if not ready:
            ready = await self._woken_by_groups(items, outcomes)
        self._awaited = set()
        if not ready:
            return outcomes
        chosen, lease = await self._lease_one(items, ready, outcomes)
        consumer = self.requests
        handed_back: Counter[str] = Counter()
        for position, index in enumerate(ready):
            if position != chosen and outcomes[index] is None:
                other = items[index][0]
                later = Later(handed_back[other.project])
                handed_back[other.project] += 1
                outcomes[index] = await consumer.settle_now(items[index][1].msg, later)
        for index, outcome in enumerate(outcomes):
            if isinstance(outcome, Deferred):
                outcomes[index] = await consumer.settle_now(items[index][1].msg, outcome)
        if lease is None:  # every ready request's model is trained by another worker
            return outcomes
        index = ready[chosen]
        request, ctx = items[index]
        self.round_robin.served(request.project)
        try:
            outcomes[index] = await self._run(request, ctx, lease)
        finally:
            await lease.release()
        return outcomes

    async def _woken_by_groups(
        self, items: list[tuple[TrainRequest, Delivery]], outcomes: list[BaseException | None]
    ) -> list[int]:
        """The waiting requests found ready when their groups' news came within
        ``FIRST_RECHECK_S`` (the soonest a hand-back would have looked again); their outcomes
        are cleared. None found: the hand-backs stand."""
        deadline = time.monotonic() + FIRST_RECHECK_S
        ready: list[int] = []
        while not ready and await self.groups_heard.wait(deadline - time.monotonic()):
            self.groups_heard.clear()
            for index, outcome in enumerate(outcomes):
                if not isinstance(outcome, Deferred):
                    continue
                request, ctx = items[index]
                try:
                    if not await self._waits_for_groups(ctx.msg, request):
                        outcomes[index] = None
                        ready.append(index)
                except Exception as exc:  # its own outcome, as in the first check
                    outcomes[index] = exc
        return ready

    async def _lease_one(
        self, items: list[tuple[TrainRequest, Delivery]], ready: list[int], outcomes: list
    ) -> tuple[int, ModelLease | None]:
        """The position in ``ready`` of the request to run, in round-robin order among those
        whose model this worker could lease, and its lease; the requests of models held by
        another worker get their outcome (``Deferred``), without occupying this one."""
        candidates = list(range(len(ready)))
        while candidates:
            position = candidates[self.round_robin.pick([items[ready[c]][0].project for c in candidates])]
            request = items[ready[position]][0]
            try:
                lease = await self.leases.acquire(request.project, request.model)
            except Exception as exc:  # NATS away: the request waits, with back-off
                outcomes[ready[position]] = DependencyUnavailable(f"model lease not acquired: {exc!r}")
                candidates.remove(position)
                continue
            if lease is not None:
                return position, lease
            for other in [c for c in candidates if _same_model(items[ready[c]][0], request)]:
                outcomes[ready[other]] = Deferred("another trainer worker holds the model", LEASED_RECHECK_S)
                candidates.remove(other)
        return -1, None

    async def _waits_for_groups(self, msg: Msg, request: TrainRequest) -> bool:
        """Whether the request is to be handed back: some of its groups are not stored yet, it
        is younger than ``group_wait_s``, and nothing already refuses it for good."""
        if (
            _age_s(msg) >= self.settings.group_wait_s
            or len(request.group_ids) > self.settings.max_request_sequences
        ):
            return False  # handle() answers it (groups never stored, or too many named)
        async with self.db.connection() as conn:
            ready = await stored_group_ids(conn, request.project, request.model, request.group_ids)
        if ready >= set(request.group_ids):
            return False
        record = await self._model_record(request)  # an unknown model is dead-lettered at once
        try:
            check_base_model(self.settings, record.project, base_model_of(record))
        except BaseModelRefused:
            return False  # handle() answers it at once
        return True

    async def _run(self, request: TrainRequest, ctx: Delivery, lease: ModelLease) -> BaseException | None:
        try:
            with self.subscriber.span(ctx, self.subscriber.attributes(request)):
                async with keep_alive(ctx.msg, self.settings.ack_wait_s):
                    await self.handle(request, lease)
            return None
        except LeaseLost as exc:
            # Another worker holds the model now and trains from its newest saved step: this
            # worker's step is dropped (never saved past the loss, never announced) and the
            # request handed back, to be answered by the holder (from the record if it trains it).
            self.policies.forget()
            return Deferred(f"{exc}; the request is handed back", LEASED_RECHECK_S)
        except (InvalidMessage, DependencyUnavailable, Deferred) as exc:
            return exc
        except PauseFailed as exc:
            # A replica that died stays registered until its heartbeat expires (30 s): an outage
            # to wait out with back-off, never a reason to dead-letter the request.
            return DependencyUnavailable(f"inference did not pause: {exc}")
        except StepCancelled:
            if lease.lost:
                return Deferred("the model's lease was lost during the step; handed back", LEASED_RECHECK_S)
            return DependencyUnavailable("the trainer stopped during the step; the request is handed back")
        except Exception as exc:  # a bug: retried, then poison (errors.py); the others are settled
            return exc

    async def handle(
        self, request: TrainRequest, lease: ModelLease | None = None
    ) -> TrainCompleted | TrainFailed:
        """The request's answer; ``lease``: the model's, held by this worker (None: alone)."""
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
            await announce.advance_registry(await self._models(), request, step)
            return await announce.complete(self.js, request, step, metrics)
        record = await self._model_record(request)
        try:
            check_base_model(self.settings, record.project, base_model_of(record))
            check_group_count(self.settings, len(request.group_ids))
            groups = await self._stored_groups(request)
            check_trajectories(self.settings, groups)
        except GroupsNotStored as exc:
            return await announce.fail(self.js, request, str(exc), retriable=True)
        except (BaseModelRefused, BudgetExceeded) as exc:
            return await announce.fail(self.js, request, str(exc), retriable=False)
        if isinstance(request, TrainSFTRequested):
            try:  # a schedule of learning rates must have one per batch: never trainable as sent
                request.config.learning_rates(sum(len(g) for g in groups))
            except ValueError as exc:
                return await announce.fail(self.js, request, str(exc), retriable=False)
        try:
            return await self._train(request, record, groups, lease)
        except StepRefused as exc:  # asking again cannot help: the agent must hear why
            return await announce.fail(self.js, request, str(exc), retriable=False)

    async def _models(self) -> KeyValue:
        """The model registry's bucket; looking it up is a round trip, so a step does it once."""
        if self._models_kv is None:
            self._models_kv = await self.js.key_value(subjects.MODELS_BUCKET)
        return self._models_kv

    async def _model_record(self, request: TrainRequest) -> ModelRecord:
        found = await read_record(await self._models(), request.project, request.model)
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

    async def _stored_groups(self, request: TrainRequest) -> list:
        """The request's groups; ``GroupsNotStored`` when some are still missing (the scheduler
        hands a request back while it is younger than ``group_wait_s``: this one is not)."""
        async with self.db.connection() as conn:
            ready = await stored_group_ids(conn, request.project, request.model, request.group_ids)
            missing = set(request.group_ids) - ready
            if missing:
                raise GroupsNotStored(
                    f"{len(missing)} of {len(set(request.group_ids))} groups were never stored"
                    f" (waited {self.settings.group_wait_s:g} s): {sorted(missing)[:5]}"
                )
            check_stored_bytes(
                self.settings, await stored_bytes(conn, request.project, request.model, request.group_ids)
            )
            return await load_groups(conn, request.project, request.model, request.group_ids)

    async def _train(
        self, request: TrainRequest, record: ModelRecord, groups: list, held: ModelLease | None = None
    ) -> TrainCompleted:
        """One step; ``held``: the model's lease in the pool (checked before saving and announcing)."""
        started = time.monotonic()
        policy, step = await self._refusing(self.policies.get(record))
        if step < record.step:
            # The model is further than any step this worker could find (neither its disk nor the
            # trainer-state store has the newest one): training here would make a step that
            # exists already. Handed back without backing the whole worker off (its other models
            # are fine), for a worker that has that step.
            raise Deferred(
                f"{record.project}/{record.name} is at step {record.step}; this worker resumes from {step}",
                STALE_RECHECK_S,
            )

        def lost() -> bool:
            return held is not None and held.lost

        already = checkpoints.step_for_request(self.settings, record, request.id)
        writing: asyncio.Future | None = None  # the step directory, written once the step is stored
        if already is not None:  # crashed after saving, before recording: publish what was saved
            new_step, metrics = already
            files = await asyncio.to_thread(
                step_files.StepFiles.read, checkpoints.step_dir(self.settings, record, new_step)
            )
        else:
            # Tokenized and measured before inference is paused: a refusal never pauses it.
            prepared = await self._refusing(self._prepare(policy, step, request, record, groups))
            saving: asyncio.Future | None = None
            try:
                async with self._hold_inference(request) as lease:
                    pause_s = time.monotonic() - started
                    result, extra = await self._refusing(
                        self._step(
                            policy,
                            step,
                            request,
                            record,
                            groups,
                            should_stop=lambda: self.stopping.is_set() or lost(),
                            prepared=prepared,
                        )
                    )
                    new_step = step + 1
                    await self._confirm(held)  # a step of a model this worker lost is never saved
                    save_started = time.monotonic()
                    snapshot = functools.partial(
                        step_files.snapshot_step, policy, new_step, request.id, result.metrics
                    )
                    saving = asyncio.ensure_future(self.policies.thread.run(snapshot))
                    replicas_paused = len(lease.outcome.acked) if lease is not None else 0
                # Taken while the replicas resume (the block's exit): they serve the step before
                # this one until this one is announced, and copying tensors needs no accelerator.
                # Shielded: a cancellation here must not cut the wait for the thread below.
                files = await asyncio.shield(saving)
            except BaseException:
                # The snapshot failed, or the step was cancelled (or the block's exit failed) while
                # it ran: its thread cannot be stopped, so it ends before the error goes on (a retry
                # never reads the policy beside it) and its failure is not lost. The policy then
                # holds a step that is not saved: the retry starts from the step saved before,
                # never from it, which would take the same step twice.
                if saving is not None:
                    if (failure := await settled(saving)) is not None:
                        log.warning("saving the step failed", step=step + 1, error=repr(failure))
                    self.policies.forget(record)
                raise
            metrics = {
                **result.metrics,
                **extra,
                "trained": float(result.trained),
                "pause_s": pause_s,
                "save_s": time.monotonic() - save_started,
                "replicas_paused": float(replicas_paused),
            }
            self.policies.advance(record, new_step)
        try:
            await self._confirm(held)  # nor announced
            await announce.publish_checkpoint(self.js, request, record, new_step, metrics, files)
            if already is None:
                # The disk is this worker's cache, written once the step is in the store (what
                # every worker shares, and what a redelivered request finds if this worker dies
                # before its disk has the step): the uploads have the cores to themselves, and
                # the write runs beside the answer and the replicas' load.
                final = checkpoints.step_dir(self.settings, record, new_step)
                writing = asyncio.ensure_future(asyncio.to_thread(files.write, final))
            return await self._answer(request, record, new_step, metrics, started)
        finally:
            # On disk before the step returns: the model's next step resumes from there.
            if writing is not None and (failure := await settled(writing)) is not None:
                self.policies.forget(record)  # resumed from the store instead
                log.warning("writing the step to disk failed", step=new_step, error=repr(failure))

    async def _answer(
        self, request: TrainRequest, record: ModelRecord, new_step: int, metrics: dict, started: float
    ) -> TrainCompleted:
        """The stored step recorded, the registry advanced, ``train.completed`` sent."""
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
        await announce.advance_registry(await self._models(), request, new_step)
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
            bf16_passes=bool(metrics.get("autocast_bf16", 0.0)),
        )
        completed = await announce.complete(self.js, request, new_step, metrics)
        await announce.prune_stored_steps(self.js, request.project, request.model, new_step)
        return completed

    async def _confirm(self, lease: ModelLease | None) -> None:
        """The model is still this worker's (``LeaseLost`` if not); the policy in memory, which
        may hold a step that will not be saved, is dropped when that cannot be said."""
        if lease is None:
            return
        try:
            await lease.confirm()
        except LeaseLost:
            self.policies.forget()
            raise
        except Exception as exc:  # NATS away: asked again later, from the last saved step
            self.policies.forget()
            raise DependencyUnavailable(f"the model's lease could not be confirmed: {exc!r}") from exc

    async def _refusing(self, work):
        """``work``'s result; its deterministic errors become ``StepRefused``, and a cancelled or
        failed step drops the policy in memory (it may hold half a step: the next request
        restores the last saved one)."""
        try:
            return await work
        except StepCancelled:
            self.policies.forget()
            raise
        except REFUSED as exc:
            if not isinstance(exc, checkpoints.ModelUnusable | BudgetExceeded):
                log.warning("step refused", error=repr(exc))
                self.policies.forget()
            raise StepRefused(_refusal(exc)) from exc

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
        self,
        policy,
        step: int,
        request: TrainRequest,
        record: ModelRecord,
        groups: list,
        *,
        should_stop: Callable[[], bool] | None = None,
        prepared=None,
    ) -> tuple:
        """The optimizer work of one request, in a thread; returns its result and extra metrics.
        ``prepared``: its sequences, from ``_prepare`` (else the policy makes them).

        Prompts are rendered with the model's ``chat_template_kwargs``, the ones the SDK sends
        with every completion request: inference rendered the sampled turns' prompts with them.

        With ``world_size`` above 1, a GRPO step runs data-parallel over that many processes
        (``distributed.train_over_processes``), which train the policy's saved state and load
        theirs back into ``policy``, the object the cache holds; SFT steps stay in this process.
        Such a step cannot be interrupted: ``should_stop`` is asked before it starts, then the
        whole step finishes or fails (a stop or a lost lease is noticed after it; a failure while
        stopping hands the request back, as a cancelled step)."""
        template = record.chat_template_kwargs
        if isinstance(request, TrainSFTRequested):
            trajectories = [t for group in groups for t in group]
            result = await self.policies.thread.run(
                policy.sft_step,
                trajectories,
                request.config,
                max_seq_len=self.settings.max_seq_len,
                chat_template_kwargs=template,
                should_stop=should_stop,
                prepared=prepared,
                autocast_mode=self.settings.autocast,
            )
            return result, {}
        extra: dict[str, float] = {}
        limit = staleness_limit(request)
        off_policy = limit is not None
        if limit is not None:  # samples older than the request allows are dropped, and counted
            groups, report = drop_stale(
                groups, model=request.model, current_step=step, max_steps_off_policy=limit
            )
            extra = report.metrics()
        if self.settings.world_size > 1:
            if should_stop is not None and should_stop():
                raise StepCancelled("the trainer is stopping")
            try:
                result = await self.policies.thread.run(
                    self._train_over_processes, policy, record, groups, request.config, off_policy
                )
            except RuntimeError as exc:
                # The workers share the service's process group: a terminal's Ctrl-C ends them
                # too. Handed back then, never refused for good like a failing step.
                if should_stop is not None and should_stop():
                    raise StepCancelled("the trainer stopped during the distributed step") from exc
                raise
            return result, extra
        result = await self.policies.thread.run(
            policy.train_step,
            groups,
            request.config,
            max_seq_len=self.settings.max_seq_len,
            temperature=self.settings.temperature,
            off_policy=off_policy,
            chat_template_kwargs=template,
            should_stop=should_stop,
            prepared=prepared,
            autocast_mode=self.settings.autocast,
        )
        return result, extra

    def _train_over_processes(
        self, policy, record: ModelRecord, groups: list, config: TrainConfig, off_policy: bool
    ) -> StepResult:
        """One GRPO step over ``world_size`` processes, from a scratch directory beside the
        model's steps (the same disk as its checkpoints, which are as large)."""
        root = checkpoints.model_dir(self.settings, record)
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".distributed-", dir=root) as workdir:
            return train_over_processes(
                policy,
                groups,
                config,
                world_size=self.settings.world_size,
                workdir=workdir,
                max_seq_len=self.settings.max_seq_len,
                temperature=self.settings.temperature,
                off_policy=off_policy,
                chat_template_kwargs=record.chat_template_kwargs,
                torch_threads=self.settings.torch_threads,
                autocast=self.settings.autocast,
            )

    async def _prepare(self, policy, step: int, request: TrainRequest, record: ModelRecord, groups: list):
        """The request's sequences, made and checked against the budgets (``BudgetExceeded``)."""
        template = record.chat_template_kwargs
        if isinstance(request, TrainSFTRequested):
            trajectories = [t for group in groups for t in group]
            return await self.policies.thread.run(
                policy.prepare_sft,
                trajectories,
                request.config,
                max_seq_len=self.settings.max_seq_len,
                chat_template_kwargs=template,
                budget=self.budget,
            )
        limit = staleness_limit(request)
        if limit is not None:  # the groups _step will train on
            groups, _ = drop_stale(groups, model=request.model, current_step=step, max_steps_off_policy=limit)
        return await self.policies.thread.run(
            policy.prepare_step,
            groups,
            request.config,
            max_seq_len=self.settings.max_seq_len,
            chat_template_kwargs=template,
            budget=self.budget,
        )


def check_finite_config(request: TrainRequest) -> None:
    """msgpack carries NaN and infinities, which JSON Schema cannot forbid: ``non_finite``."""
    non_finite = [
        name
        for name, value in msgspec.structs.asdict(request.config).items()
        if any(
            isinstance(v, float) and not math.isfinite(v)
            for v in (value if isinstance(value, list) else [value])
        )
    ]
    if non_finite:
        raise InvalidMessage(
            "non_finite", f"config {', '.join(non_finite)} must be finite", original_id=request.id
        )


def step_attributes(request: TrainRequest) -> Attributes:
    """The ``trainer.step`` span's attributes."""
    return {
        "artery.project": request.project,
        "artery.model": request.model,
        "artery.request_id": request.id,
        "artery.groups": len(request.group_ids),
        "artery.kind": "sft" if isinstance(request, TrainSFTRequested) else "grpo",
    }


def _as_sent(request: TrainRequest, ctx: Delivery) -> TrainRequest:
    return request


def base_model_of(record: ModelRecord) -> str:
    """The base model of a record ``Trainer._model_record`` let through (it refuses one without)."""
    if not record.base_model:
        raise ValueError(f"a record of project {record.project} has no base model")
    return record.base_model


def staleness_limit(request: TrainRequest) -> int | None:
    """How many steps off-policy the request's samples may be; None for a synchronous step."""
    return request.max_steps_off_policy if isinstance(request, TrainRequested) else None


def is_off_policy(request: TrainRequest) -> bool:
    """Asynchronous mode: the GRPO request names how stale its samples may be."""
    return staleness_limit(request) is not None


def model_dir(settings: TrainerSettings, project: str, model: str) -> Path:
    return Path(settings.checkpoint_dir) / project / model


def _same_model(a: TrainRequest, b: TrainRequest) -> bool:
    return (a.project, a.model) == (b.project, b.model)


def _age_s(msg: Msg) -> float:
    """Seconds since the request was stored in the stream (its first delivery's clock)."""
    stamp = msg.metadata.timestamp
    return max(0.0, time.time() - stamp.timestamp()) if stamp is not None else 0.0


def _refusal(exc: BaseException) -> str:
    """The agent's answer: the refusal's own words, or the error's kind and words."""
    if isinstance(exc, checkpoints.ModelUnusable | BudgetExceeded):
        return str(exc)
    return f"the step cannot run: {type(exc).__name__}: {exc}"
