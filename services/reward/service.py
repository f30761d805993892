"""The reward service: ``group.ready`` in, an LLM judge's scores into PostgreSQL, ``group.scored`` out.

Only groups submitted with ``reward=RewardSpec(ruler=...)`` are scored; the others already carry
final rewards and are acknowledged untouched. For each group to score:
1. a stored verdict (scores, or the error that stopped them) means the work is done: a
   redelivery or a second replica goes straight to step 3 and never pays for the judge twice;
2. the judge (RULER through litellm) ranks the group's trajectories against each other; its
   answer is retried when malformed, then the failure itself is the verdict. The verdict goes into
   a KV bucket first (``verdicts``), then into PostgreSQL: a PostgreSQL outage, a redelivery or a
   SIGKILL in between finds it there, so each group is paid for once;
3. scores: ``group.scored`` is published (its id derived from the group id, so JetStream drops a
   repeat), then the message is acked. An error: the message is dead-lettered with its kind
   (``judges.KINDS``) and the reason.

The trainer treats a group that needs a reward as ready once it has a verdict, and leaves out a
group whose verdict is an error, so a judge that cannot score a group never stalls training:
every way of giving up on a group (a judge the operator does not allow, a judge that cannot be
called as configured, one that stays down) is such a verdict, never a bare dead letter.
A judge that cannot be reached (connection refused, timeout, rate limit, 5xx) is an outage, not
bad input: the message is retried with back-off, up to ``judge_outage_max_deliveries``.
"""

from __future__ import annotations

import asyncio
import importlib.util
import uuid
from typing import Any

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from artery.schemas import GroupReady, GroupScored, JudgeUsage, Trajectory, TrajectoryScore
from artery.services.reward.judges import (
    JUDGE_CONFIG,
    JUDGE_UNAVAILABLE,
    RULER,
    JudgeRefused,
    chosen_judge,
    error_kind,
    error_text,
    failure_kind,
    judge_call_errors,
    shown,
)
from artery.services.reward.settings import RewardSettings
from artery.services.reward.store import (
    GroupKey,
    GroupToScore,
    Verdict,
    load_group,
    record_verdict,
    stored_verdict,
)
from artery.services.reward.verdicts import JudgedGroup, VerdictOutbox
from artery.shared import subjects
from artery.shared.bus import derived_id, publish_event
from artery.shared.consumer import ConsumerOptions, ConsumingService, DurableConsumer
from artery.shared.db import ServicePool
from artery.shared.errors import DependencyUnavailable, InvalidMessage
from artery.shared.logs import get_logger
from artery.shared.metrics import JUDGE_CALLS, JUDGE_COST, JUDGE_TOKENS
from artery.shared.ruler import DEFAULT_RUBRIC, RulerError, ruler_judgement
from artery.shared.subscriber import Delivery, Subscriber

log = get_logger(__name__)
SERVICE = "reward"
_SCORED_NAMESPACE = uuid.UUID("3b9e6c2a-1f4d-4e8b-a7c5-72756c657221")


def scored_event_id(project: str, model: str, group_id: str) -> str:
    return derived_id(_SCORED_NAMESPACE, project, model, group_id)


def group_key(ready: GroupReady) -> GroupKey:
    return (ready.project, ready.model, ready.group_id)


def judge_view(trajectory: Trajectory) -> list[dict[str, Any]]:
    """The conversation as the judge should read it: the sampled tokens and logprobs are the
    trainer's business (and would multiply the judge's bill), so they are left out."""
    return [
        msgspec.to_builtins(msgspec.structs.replace(m, sample=None, trainable=None))
        for m in trajectory.messages
    ]


def _failure(judge_model: str, kind: str, reason: str, *, attempts: int = 1) -> Verdict:
    """A verdict that the group cannot be scored; ``kind`` becomes its dead letter's."""
    return Verdict(judge_model, error_text(kind, reason), attempts, 0, 0, None, [])


def _delivery(msg: Msg | None) -> int:
    """Which delivery of its message this is (a direct call, as in tests, is the first)."""
    return (msg.metadata.num_delivered or 1) if msg is not None else 1


class RewardService(ConsumingService):
    def __init__(self, nc: NATS, dsn: str, settings: RewardSettings):
        self.nc = nc
        self.js = nc.jetstream()
        self.settings = settings
        self.db = ServicePool(dsn, max_size=settings.db_pool_size)
        # Each group's outcome alone: the others of the batch stand.
        self.subscriber: Subscriber[GroupReady] = Subscriber(
            GroupReady,
            service=SERVICE,
            span="reward.score_group",
            accept=lambda ready: ready.needs_reward,
            attributes=lambda ready: {"artery.group_id": ready.group_id, "artery.project": ready.project},
        )
        self._judging = asyncio.Semaphore(settings.concurrency)
        self.verdicts = VerdictOutbox(self.js)
        #: Verdicts given but not yet in PostgreSQL (group id -> verdict): a second copy, for when
        #: NATS could not take one into the outbox either.
        self._unrecorded: dict[GroupKey, JudgedGroup] = {}
        #: Per group being scored: its lock and how many deliveries hold or wait for it (``score``).
        self._group_locks: dict[GroupKey, list] = {}
        self.judge_available = importlib.util.find_spec("litellm") is not None
        self.allowed_judges = settings.allowed_judge_models()
        self.consumers = [
            DurableConsumer(
                self.js,
                service=SERVICE,
                stream=subjects.GROUPS,
                durable=subjects.REWARD_CONSUMER,
                filter_subject=subjects.GROUPS_READY,
                handler=self.subscriber.concurrently(self.handle),
                options=ConsumerOptions.from_settings(settings),
            )
        ]

    async def start(self) -> None:
        if self.judge_available:
            # litellm takes seconds to import: do it now, off the event loop, not on the first group.
            await asyncio.to_thread(importlib.import_module, "litellm")
        else:
            log.warning("litellm is not installed: groups asking for RULER will be dead-lettered")
        await super().start()

    async def handle(self, ready: GroupReady, ctx: Delivery) -> None:
        """A group that asked for a judge (the others' rewards are final: acked untouched)."""
        await self.score(ready, ctx.msg)

    async def score(self, ready: GroupReady, msg: Msg | None = None) -> GroupScored:
        """Score the group once, store the verdict, announce it (or raise it as InvalidMessage).

        Deliveries of one group are handled one at a time: a redelivery that arrives while the
        first delivery still waits for the judge (or for PostgreSQL) then finds its verdict
        instead of paying for the judge again."""
        entry = self._group_locks.setdefault(group_key(ready), [asyncio.Lock(), 0])
        entry[1] += 1  # deliveries holding or waiting for the lock
        try:
            async with entry[0]:
                return await self._score(ready, msg)
        finally:
            entry[1] -= 1
            if entry[1] == 0:
                del self._group_locks[group_key(ready)]

    async def _score(self, ready: GroupReady, msg: Msg | None) -> GroupScored:
        verdict = await self._db(stored_verdict, group_key(ready))
        if verdict is None:
            judged = await self._judged(ready, msg)
            verdict = await self._db(record_verdict, group_key(ready), judged.verdict, judged.rubric)
            log.info(
                "group scored" if verdict.error is None else "group could not be scored",
                group_id=ready.group_id,
                judge=verdict.judge_model,
                attempts=verdict.attempts,
                cost_usd=verdict.cost_usd,
                error=verdict.error,
            )
        self._unrecorded.pop(group_key(ready), None)  # PostgreSQL has it now (maybe from another replica)
        if verdict.error is not None:
            kind, reason = error_kind(verdict.error)
            raise InvalidMessage(kind, reason, original_id=ready.id)
        scored = scored_event(ready, verdict)
        try:
            await publish_event(self.js, subjects.group_scored(ready.project, ready.model), scored)
        except Exception as exc:  # the verdict is stored; the redelivery announces it again
            raise DependencyUnavailable(f"publishing group.scored failed: {exc!r}") from exc
        return scored

    async def _judged(self, ready: GroupReady, msg: Msg | None) -> JudgedGroup:
        """The group's verdict: the one already paid for (kept in the outbox, or in memory while
        NATS could not take it), else the judge's, put in the outbox before anything can fail."""
        judged = self._unrecorded.get(group_key(ready))
        if judged is None:
            judged = await self.verdicts.get(ready.project, ready.model, ready.group_id)
        if judged is not None:
            return judged
        group = await self._db(load_group, group_key(ready))
        if group is None:
            raise InvalidMessage(
                "unknown_group", f"group {ready.group_id} has no stored trajectories", original_id=ready.id
            )
        async with self._judging:
            if msg is not None:
                await msg.in_progress()  # judges are slow: do not redeliver meanwhile
            verdict = await self._judge(group, delivery=_delivery(msg))
        judged = JudgedGroup(verdict, group.spec.ruler.rubric if group.spec and group.spec.ruler else None)
        self._unrecorded[group_key(ready)] = judged  # until PostgreSQL has it
        await self.verdicts.put(ready.project, ready.model, ready.group_id, judged)
        return judged

    async def _judge(self, group: GroupToScore, delivery: int) -> Verdict:
        """The verdict on the group (``delivery``: which delivery of its message this is), or
        DependencyUnavailable while the judge is down and deliveries are left."""
        ruler = group.spec.ruler if group.spec else None
        try:  # first: a judge the group may not have is never called, whatever else is wrong
            judge_model = chosen_judge(ruler, self.settings.judge_model, self.allowed_judges)
            params = self._judge_params(group)
        except JudgeRefused as refused:
            named = (
                ruler.judge_model if ruler and ruler.judge_model is not None else self.settings.judge_model
            )
            return _failure(shown(named), refused.kind, refused.reason, attempts=0)
        tools = group.trajectories[0].tools
        try:
            judgement = await ruler_judgement(
                [judge_view(t) for t in group.trajectories],
                judge_model=judge_model,
                extra_litellm_params=params,
                rubric=(ruler.rubric if ruler else None) or DEFAULT_RUBRIC,
                tools=msgspec.to_builtins(tools) if tools else None,
                max_attempts=self.settings.max_attempts,
            )
        except RulerError as exc:
            JUDGE_CALLS.labels(judge_model, "bad_answer").inc()
            return _failure(judge_model, RULER, str(exc), attempts=self.settings.max_attempts)
        except judge_call_errors() as exc:
            JUDGE_CALLS.labels(judge_model, "call_failed").inc()
            return self._failed_call(judge_model, exc, delivery)
        JUDGE_CALLS.labels(judge_model, "scored").inc()
        JUDGE_COST.labels(judge_model).inc(judgement.cost_usd or 0.0)
        JUDGE_TOKENS.labels(judge_model, "prompt").inc(judgement.prompt_tokens)
        JUDGE_TOKENS.labels(judge_model, "completion").inc(judgement.completion_tokens)
        combine = bool(ruler and ruler.combine_with_reward)
        independent = [t.reward for t in group.trajectories]
        rows = [
            (i, s.score + independent[i] if combine else s.score, s.score, independent[i], s.explanation)
            for i, s in enumerate(judgement.scores)
        ]
        return Verdict(
            judge_model,
            None,
            judgement.attempts,
            judgement.prompt_tokens,
            judgement.completion_tokens,
            judgement.cost_usd,
            rows,
        )

    def _judge_params(self, group: GroupToScore) -> dict[str, object]:
        """The deployment's litellm parameters for the call (only ever the settings': nothing of
        the group's reaches litellm but the model, the rubric and the conversations)."""
        if not self.judge_available:
            raise JudgeRefused(
                JUDGE_CONFIG, "the reward service cannot call a judge: litellm is not installed"
            )
        if any(t.additional_histories for t in group.trajectories):
            raise JudgeRefused(RULER, "RULER does not score trajectories with additional histories")
        try:
            return self.settings.litellm_params()
        except OSError as exc:
            raise JudgeRefused(JUDGE_CONFIG, f"the judge's API key file cannot be read: {exc}") from exc

    def _failed_call(self, judge_model: str, exc: BaseException, delivery: int) -> Verdict:
        """The verdict on a judge call that raised, or DependencyUnavailable (an outage, retried
        until the group's ``judge_outage_max_deliveries``-th delivery)."""
        kind = failure_kind(exc)
        if kind == JUDGE_CONFIG:
            return _failure(judge_model, kind, f"judge {judge_model} cannot be called as configured: {exc}")
        if kind is not None:
            return _failure(judge_model, kind, f"the judge refused the request: {exc}")
        if delivery < self.settings.judge_outage_max_deliveries:
            raise DependencyUnavailable(f"judge {judge_model} unavailable: {exc!r}") from exc
        reason = f"judge {judge_model} still unavailable at delivery {delivery}: {exc}"
        return _failure(judge_model, JUDGE_UNAVAILABLE, reason, attempts=delivery)

    async def _db(self, operation, *args):
        async with self.db.connection() as conn:
            return await operation(conn, *args)


def scored_event(ready: GroupReady, verdict: Verdict) -> GroupScored:
    return GroupScored(
        id=scored_event_id(ready.project, ready.model, ready.group_id),
        project=ready.project,
        model=ready.model,
        step=ready.step,
        group_id=ready.group_id,
        split=ready.split,
        scores=[
            TrajectoryScore(
                index=index,
                score=reward,
                explanation=explanation,
                judge_score=judge_score,
                independent_reward=independent,
            )
            for index, reward, judge_score, independent, explanation in verdict.rows
        ],
        judge_model=verdict.judge_model,
        usage=JudgeUsage(
            attempts=max(1, verdict.attempts),
            prompt_tokens=verdict.prompt_tokens,
            completion_tokens=verdict.completion_tokens,
            cost_usd=verdict.cost_usd,
        ),
    )
