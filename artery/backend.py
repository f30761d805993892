"""Backends: where a model's groups go and where its step is read.

``Backend(nats_url=...)`` joins a running Artery (``artery up`` or docker compose);
``LocalBackend()`` (``artery.local.backend``, ART's path for it) first starts the embedded stack
(NATS, PostgreSQL, every service) as child processes, like ART's ``LocalBackend``. Both have the
same API. What a model needs of a backend, and what a step returns, is ``artery.backend_api``.

Traces: a backend sets up OpenTelemetry in the agent's process unless the application has (spans
are exported to ``ARTERY_OTEL_ENDPOINT`` when set). Each group goes out in an
``artery.submit_group`` span, the child of the current span (or, outside any, of the group's own
``artery.group`` span), so the collector continues the trace; ``train()`` runs in an
``artery.train`` span whose ``train.requested`` links the trainer's step to every group.

Long module: one class, the SDK's side of each exchange with a running Artery (publish, train and
its outcome, the wait until a step is served, registration), each a few methods read in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import os
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
import nats
from opentelemetry import trace

from artery.backend_api import TrainingFailed, TrainResult
from artery.dev import train_config_fields
from artery.s3_backend import S3Transport
from artery.schemas import (
    LoraSpec,
    ModelRecord,
    ReplicaInfo,
    RetentionApplied,
    RetentionRequested,
    TrainCompleted,
    TrainConfig,
    TrainFailed,
    TrainRequest,
    TrainRequested,
    TrainSFTConfig,
    TrainSFTRequested,
    new_event_id,
    utcnow,
)
from artery.shared import bus, subjects
from artery.shared.auth import secret_value
from artery.shared.permissions import provision_if_missing
from artery.shared.registry import models_kv, project_replicas, read_record, served_by_all
from artery.shared.registry import register as register_model
from artery.shared.settings import CommonSettings
from artery.shared.tracing import (
    current_trace_id,
    link_headers,
    setup_sdk_tracing,
    tracer,
)
from artery.shared.wakeup import Wakeup, woken_by
from artery.step_report import report_step
from artery.trajectories import Trajectory, TrajectoryGroup, require_rewards
from artery.utils.model_files import jsonable

if TYPE_CHECKING:
    from artery.model import Model

_outcome_decoder = msgspec.json.Decoder(TrainCompleted | TrainFailed)
#: The most trajectories ``train_sft`` publishes in one group.
SFT_GROUP_SIZE = 64
_tracer = tracer("artery.sdk")
#: Waits driven by events still look again this often, in case an event was missed.
_RECHECK_S = 2.0


@dataclass
class _ServingWatch:
    """A model's replicas as a ``train()`` waits for them to serve its step: the registry entries
    heard since the request went out (``wake``), and the replica list read meanwhile."""

    wake: Wakeup
    listing: asyncio.Future[list[ReplicaInfo]]


class _Submission:
    """What ``publish`` tells the ``train()`` around it: the spans its request links to, and the
    model's step as read for the groups, which the request carries too (read once, not twice)."""

    def __init__(self) -> None:
        self.spans: list[trace.SpanContext] = []
        self.step: int | None = None


#: Set by ``train()``: where ``publish`` notes the span of each submission and the step it read.
_submissions: contextvars.ContextVar[_Submission | None] = contextvars.ContextVar(
    "artery_submissions", default=None
)


class Backend(S3Transport):
    """A connection to a running Artery over NATS; ART's ``_experimental_*`` S3 entry points
    come from ``S3Transport``."""

    def __init__(
        self,
        nats_url: str | None = None,
        *,
        nats_creds: str | None = None,
        inference_url: str | None = None,
        inference_api_key: str | None = None,
    ):
        self.settings = CommonSettings(
            nats_url=nats_url or os.environ.get("ARTERY_NATS_URL", CommonSettings.nats_url),
            nats_creds=nats_creds or os.environ.get("ARTERY_NATS_CREDS") or None,
        )
        #: An OpenAI-compatible base URL (``http://host:port/v1``); unset: found in the registry.
        self.inference_url = inference_url or os.environ.get("ARTERY_INFERENCE_URL") or None
        self.inference_api_key = inference_api_key or secret_value(
            os.environ.get("ARTERY_INFERENCE_API_KEY") or None,
            os.environ.get("ARTERY_INFERENCE_API_KEY_FILE") or None,
            "ARTERY_INFERENCE_API_KEY",
        )
        self._nc: nats.NATS | None = None
        #: Extra ``nats.connect`` options (credentials); ``LocalBackend`` sets them when secure.
        self._nats_options: dict[str, object] = {}
        self._lock = asyncio.Lock()
        setup_sdk_tracing()

    async def _connect(self) -> nats.NATS:
        async with self._lock:
            if self._nc is None or self._nc.is_closed:
                self._nc = await bus.connect(self.settings, name="artery-sdk", **self._nats_options)
                # An agent's NATS user may check streams but not create them (admin's job).
                await provision_if_missing(self._nc.jetstream(), self.settings)
            return self._nc

    async def _js(self):
        return (await self._connect()).jetstream()

    async def _models_kv(self):
        return models_kv(await self._js())  # no STREAM.INFO: agents may not ask for it

    async def register(self, model: Model) -> None:
        """Record the model in the registry; a re-registration keeps its current step. The
        publisher validates and writes the record (``shared.registry.register``)."""
        lora = getattr(model, "lora_config", None)
        requested = ModelRecord(
            project=model.project,
            name=model.name,
            base_model=getattr(model, "base_model", None),
            trainable=model.trainable,
            config=jsonable(model.config) or {},  # ART's configs are often pydantic models
            registered_at=utcnow(),
            lora=msgspec.convert(lora, LoraSpec) if lora is not None else None,
            chat_template_kwargs=dict(getattr(model, "chat_template_kwargs", {}) or {}),
        )
        await register_model(await self._js(), requested)

    async def _inference_url(self, model: Model, timeout_s: float = 0.0) -> str | None:
        """The given URL, or the first live replica serving this model (waiting up to ``timeout_s``)."""
        if self.inference_url:
            return self.inference_url
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            replicas = await project_replicas(await self._js(), model.project, model.name)
            if replicas:
                return f"{sorted(replicas, key=lambda r: r.replica_id)[0].url}/v1"
            if asyncio.get_running_loop().time() > deadline:
                return None
            await asyncio.sleep(0.2)

    async def replicas(self, model: Model) -> list[ReplicaInfo]:
        """The live inference replicas of ``model``, from the registry."""
        return await project_replicas(await self._js(), model.project, model.name)

    async def _get_step(self, model: Model) -> int:
        found = await read_record(await self._models_kv(), model.project, model.name)
        return found.record.step if found else 0

    async def publish(
        self, model: Model, groups: Iterable[TrajectoryGroup], *, split: str = "train"
    ) -> list[str]:
        """Publish groups durably (the stream has them when this returns); return their ids."""
        step = await self._get_step(model) if model.trainable else None
        groups = list(groups)
        events = [g.to_event(project=model.project, model=model.name, step=step, split=split) for g in groups]
        current = trace.get_current_span().get_span_context()
        messages, submitted = [], []
        for group, event in zip(groups, events, strict=True):
            origin = getattr(group, "span_context", None)
            # Inside a span of the agent's, the group joins it (linked to its rollouts' span);
            # outside any, it continues the trace its rollouts ran in.
            parent = (
                None
                if current.is_valid or origin is None
                else trace.set_span_in_context(trace.NonRecordingSpan(origin))
            )
            links = [trace.Link(origin)] if origin is not None and current.is_valid else []
            with _tracer.start_as_current_span(
                "artery.submit_group",
                context=parent,
                kind=trace.SpanKind.PRODUCER,
                links=links,
                attributes={
                    "artery.project": event.project,
                    "artery.model": event.model,
                    "artery.group_id": event.id,
                    "artery.split": split,
                    "artery.trajectories": len(event.trajectories),
                },
            ) as span:
                messages.append(bus.prepare(subjects.trajectories(event.project, event.model), event))
                submitted.append(span.get_span_context())
        # Retried unchanged until acked: a lost ack (a NATS node failing over) never stores twice.
        await bus.publish_until_acked(await self._js(), messages)
        submission = _submissions.get()
        if submission is not None:  # inside train(): its request links to these spans
            submission.spans.extend(submitted)
            submission.step = step
        return [e.id for e in events]

    async def train(
        self,
        model: Model,
        groups: Iterable[TrajectoryGroup],
        *,
        config: TrainConfig | None = None,
        max_steps_off_policy: int | None = None,
        timeout_s: float | None = None,
        wait_for_serving_s: float = 120.0,
        **config_fields,
    ) -> TrainResult:
        """One GRPO step on ``groups``; returns once the new adapter is served by every replica.

        ``max_steps_off_policy`` (asynchronous mode): inference keeps serving while the step
        trains; trajectories sampled more than that many steps before it are dropped and the rest
        corrected for the policy gap (see ``TrainRequested``). Keyword arguments not named here are
        ``TrainConfig`` fields (``learning_rate=``, ``loss_fn=``...) or ART's ``backend.train``
        keywords (``art.dev.TrainConfig`` keys).
        """
        groups = list(groups)
        require_rewards(groups)  # a reward never given is refused, not trained as 0.0
        # ART's keywords (``ppo=``, ``normalize_advantages=``, ``importance_sampling_level=``...) are
        # translated or refused by name (``artery.dev``), never passed through unread.
        fields = train_config_fields(config_fields)
        config = msgspec.structs.replace(config or TrainConfig(), **fields) if fields else config
        request = functools.partial(
            TrainRequested, config=config or TrainConfig(), max_steps_off_policy=max_steps_off_policy
        )
        return await self._train("artery.train", model, groups, request, timeout_s, wait_for_serving_s)

    async def train_sft(
        self,
        model: Model,
        trajectories: Iterable[Trajectory],
        config: TrainSFTConfig | None = None,
        *,
        timeout_s: float | None = None,
        wait_for_serving_s: float = 120.0,
    ) -> TrainResult:
        """Supervised fine-tuning (ART's ``train_sft``): one step of cross-entropy on the
        trajectories' assistant turns, ``config.batch_size`` trajectories per optimizer update, in
        order; returns once the new adapter is served by every replica, like ``train()``."""
        config = config or TrainSFTConfig()
        trajectories = list(trajectories)
        if not trajectories:
            raise ValueError("train_sft() needs at least one trajectory")
        config.learning_rates(len(trajectories))  # a schedule without one rate per batch fails here
        # Groups only carry the trajectories to the trainer, which trains them in order: one per
        # batch (at most ``SFT_GROUP_SIZE``) keeps each message far below the collector's limits.
        size = min(config.resolved_batch_size(), SFT_GROUP_SIZE)
        groups = [TrajectoryGroup(trajectories[i : i + size]) for i in range(0, len(trajectories), size)]
        request = functools.partial(TrainSFTRequested, config=config)
        return await self._train("artery.train_sft", model, groups, request, timeout_s, wait_for_serving_s)

    async def _train(
        self,
        span_name: str,
        model: Model,
        groups: Iterable[TrajectoryGroup],
        make_request: Callable[..., TrainRequest],
        timeout_s: float | None,
        wait_for_serving_s: float,
    ) -> TrainResult:
        """Publish the groups, ask for a step (``make_request`` builds the request from its
        envelope and the group ids), await its outcome, then wait until the new step is served."""
        attributes = {"artery.project": model.project, "artery.model": model.name}
        with _tracer.start_as_current_span(span_name, attributes=attributes) as span:
            submitted = _Submission()
            token = _submissions.set(submitted)
            try:
                group_ids = await self.publish(model, groups, split="train")
            finally:
                _submissions.reset(token)
            if not group_ids:
                raise ValueError("train() needs at least one group")
            # Opened before the request: a replica may serve the step before its answer arrives
            # here (it loads the step as saved; the trainer answers once it has recorded it).
            async with self._serving_watch(model) as serving:
                outcome = await self._request_step(model, make_request, group_ids, submitted, timeout_s)
                if isinstance(outcome, TrainFailed):
                    raise TrainingFailed(outcome.error, retriable=outcome.retriable)
                await self._wait_until_served(model, outcome.step, wait_for_serving_s, serving)
            span.set_attribute("artery.step", outcome.step)
            result = TrainResult.of(outcome.step, dict(outcome.metrics), current_trace_id())
            report_step(model, result)
            return result

    async def _request_step(
        self,
        model: Model,
        make_request: Callable[..., TrainRequest],
        group_ids: list[str],
        submitted: _Submission,
        timeout_s: float | None,
    ):
        """Publish the train request for ``group_ids`` and await its outcome (``TrainCompleted``
        or ``TrainFailed``)."""
        nc = await self._connect()
        outcome_subject = subjects.train("*", model.project, model.name)
        sub = await nc.subscribe(outcome_subject)  # before publishing, so no answer is missed
        try:
            request = make_request(
                id=new_event_id(),
                project=model.project,
                model=model.name,
                # The policy version publish() read for the groups: the request names the
                # same, without a second registry round trip on the way of every step.
                step=submitted.step if submitted.step is not None else await self._get_step(model),
                group_ids=group_ids,
            )
            # Both kinds of request go to the same subject (the trainer tells them apart by
            # tag); its step span is the child of this one and links to every submission.
            await bus.publish_event(
                nc.jetstream(),
                subjects.train("requested", model.project, model.name),
                request,
                headers=link_headers({}, submitted.spans),
            )
            return await self._await_outcome(sub, request.id, timeout_s)
        finally:
            await sub.unsubscribe()

    async def _await_outcome(self, sub, request_id: str, timeout_s: float | None):
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        while True:
            remaining = None if deadline is None else max(deadline - loop.time(), 0.001)
            try:
                msg = await sub.next_msg(timeout=remaining if remaining is not None else 3600)
            except nats.errors.TimeoutError:
                if deadline is not None and loop.time() >= deadline:
                    raise TimeoutError(
                        f"no answer to train request {request_id} within {timeout_s}s"
                    ) from None
                continue
            try:
                outcome = _outcome_decoder.decode(msg.data)
            except msgspec.DecodeError:
                continue  # a train.requested of someone else's, or garbage: not ours
            if outcome.request_id == request_id:
                return outcome

    @contextlib.asynccontextmanager
    async def _serving_watch(self, model: Model) -> AsyncIterator[_ServingWatch]:
        """The registry entries of ``model``'s replicas heard from now on, and its replica list,
        read in the background: opened before a train request goes out, a step served before its
        answer comes is then found served with no round trip after the answer."""
        keys = subjects.replica_keys(model.project, model.name)
        async with woken_by(
            await self._connect(),
            subjects.kv_updates(subjects.REPLICAS_BUCKET, keys),
            waiter="sdk_until_served",
        ) as wake:
            listing = asyncio.ensure_future(project_replicas(await self._js(), model.project, model.name))
            try:
                yield _ServingWatch(wake, listing)
            finally:
                listing.cancel()
                with contextlib.suppress(BaseException):
                    await listing

    async def _wait_until_served(
        self, model: Model, step: int, timeout_s: float, watch: _ServingWatch | None = None
    ) -> None:
        """Every live replica of the model lists ``<model>@<step>`` (they load it after publication).

        Woken by the replicas' registry entries changing (a replica writes its entry the moment it
        serves a new step), not by a timer; the registry is read again at least every
        ``_RECHECK_S`` in case a change was missed (a reconnect). ``watch``: one opened before
        the step was asked for (``_serving_watch``), else one is opened now.

        The replica list is read while the replicas still load the step (or train it); the entry
        that wakes this wait usually completes the answer with that list, and the list is read
        again (the control plane asked, a round trip on the way of every step) only when it does
        not."""
        if watch is None:
            async with self._serving_watch(model) as opened:
                return await self._wait_until_served(model, step, timeout_s, opened)
        name = model.get_inference_name(step)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        wake = watch.wake
        try:
            replicas: list[ReplicaInfo] | None = await watch.listing
        except Exception:  # read again below, where a failure is the caller's
            replicas = None
        while True:
            wake.clear()  # before reading: a change during the read wakes the next wait
            # The entries heard count as read: the stream stores a put after plain subscribers
            # hear it, so a read right after the wake-up can miss it, and nothing else would
            # come before the safety net (the missed wake-ups of #31). The list was read after
            # the subscription began: nothing since is missing from the two together.
            if replicas is not None and served_by_all(name, replicas, wake.latest.values(), joined=True):
                wake.satisfied()
                return
            replicas = await project_replicas(await self._js(), model.project, model.name)
            if served_by_all(name, replicas, wake.latest.values(), joined=False):
                wake.satisfied()
                return
            remaining = deadline - loop.time()
            if remaining <= 0:
                lagging = [r.replica_id for r in replicas if name not in r.served]
                raise TimeoutError(f"{name} not served within {timeout_s}s by {lagging}")
            await wake.wait(min(remaining, _RECHECK_S))

    async def delete_checkpoints(
        self,
        model: Model,
        *,
        best_checkpoint_metric: str | None = "reward_mean",
        keep_latest: int = 1,
        keep_steps: Iterable[int] = (),
    ) -> RetentionApplied:
        """Keep the latest step(s), the best by the metric and ``keep_steps``; the publisher
        deletes the rest."""
        nc = await self._connect()
        request = RetentionRequested(
            id=new_event_id(),
            project=model.project,
            model=model.name,
            keep_latest=keep_latest,
            best_metric=best_checkpoint_metric,
            keep_steps=sorted(set(keep_steps)),
        )
        reply = await nc.request(
            subjects.retention_request(model.project, model.name),
            msgspec.json.encode(request),
            timeout=30,
            headers=bus.event_headers(request),
        )
        applied = msgspec.json.decode(reply.data, type=RetentionApplied)
        if applied.error:
            raise RuntimeError(f"retention failed: {applied.error}")
        return applied

    async def close(self) -> None:
        if self._nc is not None and not self._nc.is_closed:
            await bus.close(self._nc)
        self._nc = None

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
