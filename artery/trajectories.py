"""``art.Trajectory`` and ``art.TrajectoryGroup``: ART's shape, Artery's wire underneath."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import inspect
import time
import warnings
from collections.abc import Awaitable, Coroutine, Generator, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, overload

import msgspec
from opentelemetry import trace

from artery import convert
from artery.capture import group_scope, hooks, scope
from artery.capture.conversations import Conversation, conversations
from artery.capture.exchanges import Exchange, Kind, TrajectoryExchanges
from artery.capture.group_scope import exception_record
from artery.gather_context import current_gather
from artery.schemas import History as WireHistory
from artery.schemas import RewardSpec, Tool, TrajectoryException, TrajectoryGroupSubmitted, new_event_id
from artery.schemas import Trajectory as WireTrajectory
from artery.shared.contract import check_finite
from artery.shared.errors import InvalidMessage
from artery.shared.served_name import parse_served_name
from artery.shared.tracing import tracer
from artery.unstarted import close_unstarted
from artery.utils import pydantic_surface
from artery.utils.reward_given import NoReward

_tracer = tracer("artery.sdk")


def _tools(tools: list[Any] | None) -> list[Tool] | None:
    if tools is None:
        return None
    return [t if isinstance(t, Tool) else msgspec.convert(convert._as_dict(t), Tool) for t in tools]


def require_rewards(groups: Iterable[TrajectoryGroup]) -> None:
    """Refuse groups holding a trajectory whose reward was never given, unless the reward service
    gives them theirs (RULER without ``combine_with_reward``)."""
    for n, group in enumerate(groups):
        judge = getattr(group.reward, "ruler", None)
        if judge is not None and not judge.combine_with_reward:
            continue
        missing = [i for i, t in enumerate(group.trajectories) if isinstance(t.reward, NoReward)]
        if missing:
            raise ValueError(
                f"group {n}: trajectories {missing} have no reward. Set `trajectory.reward` (ART 0.3"
                " requires one; Artery never takes a missing reward as 0.0), or have the group scored"
                " (`art.rewards.ruler_score_group`, or `reward=art.RewardSpec(ruler=art.RulerSpec(...))`)"
            )


@dataclass
class History:
    messages_and_choices: list[Any] = field(default_factory=list)
    tools: list[Any] | None = None

    def to_wire(self) -> WireHistory:
        return WireHistory(messages=convert.to_messages(self.messages_and_choices), tools=_tools(self.tools))


@dataclass
class Trajectory:
    """One rollout: the conversation, the reward, and whatever the agent wants to keep."""

    messages_and_choices: list[Any] = field(default_factory=list)
    tools: list[Any] | None = None
    additional_histories: list[History] = field(default_factory=list)
    reward: float = field(default_factory=NoReward)
    initial_policy_version: int | None = None
    final_policy_version: int | None = None
    metrics: dict[str, float | int | bool] = field(default_factory=dict)
    metadata: dict[str, float | int | str | bool | None] = field(default_factory=dict)
    logs: list[str] = field(default_factory=list)
    start_time: dt.datetime = field(default_factory=lambda: dt.datetime.now(dt.UTC), repr=False)
    #: The model calls a capture scope recorded (``with trajectory:``, ``art.trajectory(...)``).
    exchanges: TrajectoryExchanges = field(default_factory=TrajectoryExchanges, repr=False)

    # --------------------------------------------------------------------- capture scope

    def __enter__(self) -> Trajectory:
        """Record every model call made inside (this task and what it starts) into ``exchanges``."""
        hooks.install()
        scope.enter(self)
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        scope.leave(self)
        self.finish()
        # The enclosing ``with TrajectoryGroup():`` keeps it, or its failure (a cancelled
        # rollout is no failure of the agent's).
        if isinstance(exc, Exception):
            group_scope.rollout_failed(exc)
        elif exc is None:
            group_scope.trajectory_ended(self)

    def record_exchange(self, kind: Kind, exchange: Exchange) -> None:
        with scope.record_lock:
            self.exchanges.add(kind, exchange)
            policy = parse_served_name(exchange.model or "")  # ``<model>@<step>``
            if policy is not None:
                if self.initial_policy_version is None:
                    self.initial_policy_version = policy[1]
                self.final_policy_version = policy[1]

    def sent_conversations(self) -> list[Conversation | Trajectory | History]:
        """What is sent, trained on and logged, the main conversation first: the exchanges as
        conversations, or the messages the agent built (a trajectory holds one or the other, as
        in ART)."""
        if not self.exchanges:
            return [self, *self.additional_histories]
        if self.messages_and_choices or self.additional_histories:
            raise ValueError(
                "a trajectory holds captured exchanges or messages_and_choices/additional_histories, not both"
            )
        return [*conversations(self.exchanges)] or [Conversation()]

    def log(self, message: str) -> None:
        self.logs.append(message)

    def finish(self) -> Trajectory:
        self.metrics["duration"] = (dt.datetime.now(dt.UTC) - self.start_time).total_seconds()
        return self

    @contextlib.asynccontextmanager
    async def track_duration(self, metric_name: str):
        """Add the time spent inside the block to ``metrics[f"{metric_name}_duration"]``."""
        start = time.monotonic()
        try:
            yield
        finally:
            key = f"{metric_name}_duration"
            self.metrics[key] = float(self.metrics.get(key, 0.0)) + time.monotonic() - start

    def messages(self) -> list[dict[str, Any]]:
        """The conversation as OpenAI message dicts (choices become assistant messages)."""
        out = []
        for message in convert.to_messages(self.sent_conversations()[0].messages_and_choices):
            item = msgspec.to_builtins(message)
            item.pop("sample", None)
            item.pop("trainable", None)
            if message.role == "assistant":
                item.setdefault("content", "")
            out.append(item)
        return out

    # ART's Trajectory is a pydantic model; its examples call these (``artery.utils.pydantic_surface``).
    def model_dump(self, *, mode: str = "python") -> dict[str, Any]:
        return pydantic_surface.trajectory_dump(self, mode)

    def model_copy(self, *, update: dict[str, Any] | None = None, deep: bool = False) -> Trajectory:
        return pydantic_surface.copy_with(self, update, deep)

    def for_logging(self) -> dict[str, Any]:
        return pydantic_surface.for_logging(self)

    def to_wire(self) -> WireTrajectory:
        main, *others = self.sent_conversations()
        return WireTrajectory(
            messages=convert.to_messages(main.messages_and_choices),
            tools=_tools(main.tools),
            additional_histories=[
                WireHistory(messages=convert.to_messages(h.messages_and_choices), tools=_tools(h.tools))
                for h in others
            ],
            reward=float(self.reward),
            initial_policy_version=self.initial_policy_version,
            final_policy_version=self.final_policy_version,
            metrics=dict(self.metrics),
            metadata=dict(self.metadata),
            logs=list(self.logs),
        )


class _GroupFields:
    """``TrajectoryGroup``'s fields. Its ``__init__`` lives here, apart from ``__new__``: a type
    checker then reads the constructor from ``__new__``, which says what awaitables make."""

    _given: list[Any]  # what ``__new__`` read from the iterable, for ``__init__``

    def __init__(
        self,
        trajectories: Iterable[Trajectory] = (),
        *,
        exceptions: list[BaseException | TrajectoryException] | None = None,
        metadata: dict[str, Any] | None = None,
        metrics: dict[str, float | int | bool] | None = None,
        logs: list[str] | None = None,
        reward: RewardSpec | None = None,
    ):
        given = self.__dict__.pop("_given", None)
        self.trajectories: list[Trajectory] = given if given is not None else list(trajectories)
        self.exceptions = [
            e if isinstance(e, TrajectoryException) else exception_record(e) for e in exceptions or []
        ]
        self.metadata = dict(metadata or {})
        self.metrics = dict(metrics or {})
        self.logs = list(logs or [])
        #: How the reward service should score the group (RULER); unset: the agent's rewards.
        self.reward = reward
        #: The ``artery.group`` span its rollouts ran in (set when it was gathered from awaitables).
        self.span_context: trace.SpanContext | None = None


class TrajectoryGroup(_GroupFields):
    """Rollouts of the same input, compared with each other by GRPO.

    ``with TrajectoryGroup() as group:`` collects every trajectory whose scope ends inside (in
    this task and the ones it starts), in completion order, and the exceptions that ended them.

    Given awaitables (``TrajectoryGroup(rollout(s) for _ in range(8))``, deprecated as in ART:
    ``await art.trajectory_group(...)``), the constructor returns an awaitable that runs them
    concurrently, keeps the exceptions (within the enclosing ``gather_trajectory_groups``'s
    ``max_exceptions``) and updates its progress bar.
    """

    @overload
    def __new__(
        cls,
        trajectories: Iterable[Trajectory] = (),
        *,
        exceptions: list[BaseException | TrajectoryException] | None = None,
        metadata: dict[str, Any] | None = None,
        metrics: dict[str, float | int | bool] | None = None,
        logs: list[str] | None = None,
        reward: RewardSpec | None = None,
    ) -> TrajectoryGroup: ...

    # mypy wants ``__new__`` to return an instance; this one returns an awaitable of one (as ART's).
    @overload
    def __new__(  # type: ignore[misc]
        cls,
        trajectories: Iterable[Awaitable[Trajectory]],
        *,
        exceptions: list[BaseException | TrajectoryException] | None = None,
        metadata: dict[str, Any] | None = None,
        metrics: dict[str, float | int | bool] | None = None,
        logs: list[str] | None = None,
        reward: RewardSpec | None = None,
    ) -> Awaitable[TrajectoryGroup]: ...

    def __new__(cls, trajectories: Iterable[Any] = (), **kwargs: Any) -> Any:
        items = list(trajectories)
        if any(inspect.isawaitable(item) for item in items):
            _warn_awaitables()
            return _PendingGroup(_gather_group(cls, items, kwargs), items)
        group = super().__new__(cls)
        group._given = items  # a generator can be read once: __init__ takes this list
        return group

    def __enter__(self) -> TrajectoryGroup:
        group_scope.enter(self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        group_scope.leave(self)

    def __iter__(self) -> Iterator[Trajectory]:
        return iter(self.trajectories)

    def __len__(self) -> int:
        return len(self.trajectories)

    def model_dump(self, *, mode: str = "python") -> dict[str, Any]:
        return pydantic_surface.group_dump(self, mode)

    def model_copy(self, *, update: dict[str, Any] | None = None, deep: bool = False) -> TrajectoryGroup:
        # A copy is another group: it gets its own event id when published.
        return pydantic_surface.copy_with(self, update, deep, fresh=("_given", "_event_id", "_sent"))

    def __repr__(self) -> str:
        rewards = [round(t.reward, 3) for t in self.trajectories]
        return f"TrajectoryGroup(rewards={rewards}, exceptions={len(self.exceptions)})"

    def to_event(
        self, *, project: str, model: str, step: int | None = None, split: str = "train"
    ) -> TrajectoryGroupSubmitted:
        if not self.trajectories:
            raise ValueError("a trajectory group needs at least one trajectory")
        # One id per group, whatever the number of calls: publishing the same group again (a retry
        # after an error) is then de-duplicated by JetStream and the collector, never stored twice.
        if getattr(self, "_event_id", None) is None:
            self._event_id = new_event_id()
        event = TrajectoryGroupSubmitted(
            id=self._event_id,
            project=project,
            model=model,
            step=step,
            trajectories=[t.to_wire() for t in self.trajectories],
            exceptions=list(self.exceptions),
            metadata=dict(self.metadata),
            metrics=dict(self.metrics),
            logs=list(self.logs),
            split=split,
            reward=self.reward,
        )
        try:  # the collector's own check, so the agent hears of it now and not in a dead letter
            check_finite(event)
        except InvalidMessage as exc:
            raise ValueError(f"{exc.kind}: {exc.reason}") from None
        # Sent again unchanged (ART's ``model.log(groups, split="train")`` after ``train()``, when the
        # step has moved on), a group is the same event, byte for byte: a redelivery, never a conflict.
        sent = getattr(self, "_sent", None)
        if sent is not None and msgspec.structs.replace(event, time=sent.time, step=sent.step) == sent:
            return sent
        self._sent = event
        return event


_warned = False


def _warn_awaitables() -> None:
    """Once per process, as Artery's own loops still build groups this way."""
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(
            "`TrajectoryGroup(awaitables)` is deprecated: use `await art.trajectory_group(...)`",
            DeprecationWarning,
            stacklevel=3,
        )


class _PendingGroup:
    """What ``TrajectoryGroup(awaitables)`` returns: awaited, it runs the rollouts; never
    started (a batch skipped or cut short), ``close_unstarted`` closes them as well."""

    def __init__(self, run: Coroutine[Any, Any, TrajectoryGroup], items: list[Any]) -> None:
        self._run, self._items = run, items

    def __await__(self) -> Generator[Any, None, TrajectoryGroup]:
        return self._run.__await__()

    def close_unstarted(self) -> None:
        if inspect.getcoroutinestate(self._run) == inspect.CORO_CREATED:
            self._run.close()
            close_unstarted(self._items)


async def _gather_group(cls, items: list[Any], kwargs: dict[str, Any]) -> TrajectoryGroup:
    context = current_gather()
    if context is not None:
        context.add_total(len(items))

    async def run(item):
        try:
            with _tracer.start_as_current_span("artery.rollout"):  # the agent's requests inside
                result = await item if inspect.isawaitable(item) else item
        except Exception as exc:
            if context is None:
                raise
            context.record_exception(exc)
            return exc
        if context is not None:
            context.record_trajectory(result)
        return result

    with _tracer.start_as_current_span("artery.group", attributes={"artery.rollouts": len(items)}) as span:
        try:
            results = await asyncio.gather(*(run(item) for item in items))
        finally:  # cancelled: the rollouts that never started are closed, not left to warn
            close_unstarted(items)
    trajectories = [r for r in results if isinstance(r, Trajectory)]
    exceptions = [r for r in results if isinstance(r, BaseException)]
    exceptions += list(kwargs.pop("exceptions", None) or [])
    group = cls(trajectories, exceptions=exceptions, **kwargs)
    span_context = span.get_span_context()
    group.span_context = span_context if span_context.is_valid else None
    return group
