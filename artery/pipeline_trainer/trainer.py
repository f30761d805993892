"""``PipelineTrainer``: ART's asynchronous loop — rollouts never wait for training to finish.

Rollout workers take scenarios and produce groups into a queue while the training stage takes
batches from it and trains. A worker starts a rollout only while the group would be at most
``max_steps_off_policy`` steps old when a batch takes it: the step that will take it is foreseen
from the groups already ahead of it (queued or being rolled out), a batch of ``max_batch_size``
per step. Without that foresight, workers faster than training fill the queue with groups that
are too old by the time they reach the front (ART's gate looks at the policy alone). Groups that
still fell behind (batches smaller than the largest, rollouts slower than foreseen) are discarded
and counted. Each training call is an
asynchronous step on the services: inference keeps serving while the trainer computes the next
step (``Backend.train(max_steps_off_policy=...)``), which also drops stale trajectories and corrects
the rest by truncated importance sampling. Groups whose rewards are all equal teach nothing: they
go to a discard queue, and when it holds ``discard_queue_multiplier * min_batch_size`` of them in a
row the policy is taken to have collapsed and the run stops with an error.

Sizes come from ``pipeline=PipelineRuntimeConfig(...)`` (or the keywords of the same names);
``autotune=PipelineAutotuneConfig(mode="online")`` moves the number of rollout workers while it
runs (``artery.pipeline_config``). Each step logs, beside the trainer's metrics, the pipeline's
own in ART's taxonomy (``objective/score``, ``throughput/``, ``queue/``...; ``artery.metrics``).

Resumable: the scenario offset and the step are kept in the model directory
(``pipeline_state.json``), so ``train()`` after a restart skips the scenarios already used.

Long module: one class, ART's ``PipelineTrainer``: its two stages (rollout workers and training)
share the queue, the policy version and the gate, and read best side by side.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from tqdm.auto import tqdm

from artery.errors import LocalServingUnavailableError, is_connection_failure
from artery.model import TrainableModel
from artery.pipeline_config import PipelineAutotuneConfig, PipelineRuntimeConfig, next_rollout_workers
from artery.pipeline_trainer.step_meter import StepMeter
from artery.trajectories import Trajectory, TrajectoryGroup

if TYPE_CHECKING:
    from artery.backend import Backend

ScenarioT = TypeVar("ScenarioT")
ConfigT = TypeVar("ConfigT")
RolloutFn = Callable[[TrainableModel, ScenarioT, ConfigT], Awaitable[TrajectoryGroup]]
SingleRolloutFn = Callable[[TrainableModel, ScenarioT, ConfigT], Awaitable[Trajectory]]
EvalFn = Callable[[TrainableModel, int, ConfigT], Awaitable[list[TrajectoryGroup] | None]]
STATE_FILE = "pipeline_state.json"


class PolicyCollapsed(RuntimeError):
    """Too many groups in a row had all-equal rewards: nothing is left to learn from."""


def make_group_rollout_fn(single_rollout_fn: SingleRolloutFn, n: int = 4) -> RolloutFn:
    """A group rollout of ``n`` single rollouts of the same scenario, run concurrently."""

    async def group_rollout(model: TrainableModel, scenario: Any, config: Any) -> TrajectoryGroup:
        return await TrajectoryGroup(single_rollout_fn(model, scenario, config) for _ in range(n))

    return group_rollout


async def _as_async(items: Iterable[Any] | AsyncIterator[Any]) -> AsyncIterator[Any]:
    if isinstance(items, AsyncIterator):
        async for item in items:
            yield item
    else:
        for item in items:
            yield item


class PipelineTrainer(Generic[ScenarioT, ConfigT]):
    """ART's ``PipelineTrainer`` on Artery's services (``from artery.pipeline_trainer import ...``)."""

    # The state of one run: ``train()`` makes it anew each time (its loop's queue and condition).
    _policy_updated: asyncio.Condition
    _queue: asyncio.Queue[TrajectoryGroup | None]
    _scenarios: AsyncIterator[Any]
    _scenario_lock: asyncio.Lock
    _pbar: tqdm
    _equal_in_a_row: int

    def __init__(
        self,
        model: TrainableModel,
        backend: Backend,
        rollout_fn: RolloutFn,
        scenarios: AsyncIterator[ScenarioT] | Iterable[ScenarioT],
        config: ConfigT,
        eval_fn: EvalFn | None = None,
        *,
        num_rollout_workers: int | None = None,
        min_batch_size: int | None = None,
        max_batch_size: int | None = None,
        max_steps_off_policy: int = 4,
        queue_maxsize: int | None = None,
        pipeline: PipelineRuntimeConfig | None = None,
        autotune: PipelineAutotuneConfig | None = None,
        learning_rate: float = 1e-5,
        loss_fn: str = "cispo",
        loss_fn_config: dict | None = None,
        normalize_advantages: bool = True,
        adam_params: object | None = None,
        max_steps: int | None = None,
        discard_queue_multiplier: int = 100,
        log_interval_seconds: float = 60.0,
        total_scenarios: int | None = None,
        eval_every_n_steps: int = 20,
        eval_step_0: bool = True,
        save_checkpoint: bool = True,
        resume: bool = True,
    ) -> None:
        sizes = {
            "num_rollout_workers": num_rollout_workers,
            "min_batch_size": min_batch_size,
            "max_batch_size": max_batch_size,
            "queue_maxsize": queue_maxsize,
        }
        given = {k: v for k, v in sizes.items() if v is not None}
        if pipeline is not None and (given or autotune is not None):
            # As ART: one source of sizes (the autotune chooses its own as it goes).
            raise ValueError(
                "PipelineTrainer(pipeline=...) cannot be combined with autotune or size keywords"
            )
        pipeline = pipeline or PipelineRuntimeConfig(**given)  # validates the keywords too
        num_rollout_workers, min_batch_size = pipeline.num_rollout_workers, pipeline.min_batch_size
        max_batch_size, queue_maxsize = pipeline.max_batch_size, pipeline.queue_maxsize
        if max_steps_off_policy < 0 or eval_every_n_steps < 0 or discard_queue_multiplier <= 0:
            raise ValueError("max_steps_off_policy, eval_every_n_steps >= 0 and discard multiplier > 0")
        # ART's knobs for its own trainer; Artery's trainer has no such setting: say so, never ignore.
        for name, value in (("loss_fn_config", loss_fn_config), ("adam_params", adam_params)):
            if value is not None:
                raise ValueError(f"PipelineTrainer({name}=...) is not supported by Artery's trainer")
        if not save_checkpoint:
            raise ValueError("PipelineTrainer(save_checkpoint=False): every Artery step is a checkpoint")
        self.model, self.backend, self.rollout_fn = model, backend, rollout_fn
        self.scenarios, self.config, self.eval_fn = scenarios, config, eval_fn
        self.num_rollout_workers = num_rollout_workers
        self.autotune = autotune if autotune is not None and autotune.mode == "online" else None
        self.pipeline = pipeline
        self._meter = StepMeter()
        self._live_workers, self._workers_open = 0, False
        #: Each autotune decision (steps done, workers, action, reason), for people and tests.
        self.autotune_decisions: list[tuple[int, int, str, str]] = []
        self.min_batch_size = min_batch_size
        self.max_batch_size = max_batch_size or 10 * min_batch_size
        self.max_steps_off_policy = max_steps_off_policy
        self.queue_maxsize = queue_maxsize or max(1, (max_steps_off_policy + 1) * self.max_batch_size)
        # ``TrainConfig`` fields, as ``Backend.train`` takes them.
        self.train_kwargs: dict[str, Any] = {"learning_rate": learning_rate, "loss_fn": loss_fn}
        if not normalize_advantages:
            self.train_kwargs["normalize_advantages"] = False
        self.max_steps = max_steps
        self.discard_limit = discard_queue_multiplier * min_batch_size
        self.log_interval_seconds = log_interval_seconds
        self.total_scenarios = total_scenarios
        self.eval_every_n_steps, self.eval_step_0 = eval_every_n_steps, eval_step_0
        self.resume = resume
        # Run state (``train()`` sets it up).
        self.policy_version = 0
        self.next_training_step = 0
        self.scenario_offset = 0
        self.discarded_stale = 0
        self.discarded_equal = 0
        #: Groups started and not yet taken by a batch (queued, or still being rolled out).
        self._ahead = 0
        self._done = False

    # ------------------------------------------------------------------ state

    @property
    def _state_path(self):
        return self.model.directory / STATE_FILE

    def _read_state(self) -> dict[str, Any]:
        path = self._state_path
        return json.loads(path.read_text()) if self.resume and path.exists() else {}

    def _write_state(self, step: int) -> None:
        path = self._state_path
        path.parent.mkdir(parents=True, exist_ok=True)
        state = {"training_step": step, "scenario_offset": self.scenario_offset}
        temporary = path.with_suffix(".tmp")
        temporary.write_text(json.dumps(state))
        temporary.replace(path)

    # ------------------------------------------------------------------ the run

    async def train(self) -> None:
        """Run rollouts and training until the scenarios (or ``max_steps``) run out."""
        start = await self.model.get_step()
        state = self._read_state()
        self.policy_version = self.next_training_step = start
        self._ahead = 0
        self._policy_updated = asyncio.Condition()
        self._queue = asyncio.Queue(maxsize=self.queue_maxsize)
        scenarios = _as_async(self.scenarios)
        skip = int(state.get("scenario_offset", 0))
        for _ in range(skip):  # resumed: the scenarios already used are not rolled out again
            if await anext(scenarios, None) is None:
                break
        self.scenario_offset = skip
        self._scenarios = scenarios
        self._scenario_lock = asyncio.Lock()
        self._meter = StepMeter(getattr(self.backend, "gpu_cost_per_hour_usd", None))
        self._pbar = tqdm(total=self.total_scenarios, initial=skip, desc="pipeline", unit="group")
        try:
            if self.eval_fn is not None and self.eval_step_0 and start == 0:
                await self._evaluate(0)
            try:
                async with asyncio.TaskGroup() as tasks:
                    rollouts = tasks.create_task(self._rollout_stage())
                    training = tasks.create_task(self._training_stage())
                    await training
                    rollouts.cancel()  # training has what it needs (max_steps) or the queue ended
            except ExceptionGroup as group:  # a stage failed: its error, not a wrapper, is the news
                raise group.exceptions[0] from None
        finally:
            self._pbar.close()

    async def _next_scenario(self) -> tuple[bool, Any]:
        async with self._scenario_lock:
            scenario = await anext(self._scenarios, _END)
            if scenario is _END:
                return False, None
            self.scenario_offset += 1
            return True, scenario

    def foreseen_age(self) -> int:
        """How many steps old a group started now would be when a batch takes it: the batch after
        the one in training (or being collected) is step ``next_training_step``, and every full
        batch of groups ahead of it takes a step more."""
        return self.next_training_step + self._ahead // self.max_batch_size - self.policy_version

    async def _start_rollout(self) -> None:
        """Wait until a group started now would be fresh enough when taken, and count it ahead.
        Never a deadlock: a worker waits only while a whole batch is ahead (queued, or rolled out
        by another worker), which the training stage takes without it."""
        started = time.monotonic()
        async with self._policy_updated:
            await self._policy_updated.wait_for(
                lambda: self._done or self.foreseen_age() <= self.max_steps_off_policy
            )
            self._ahead += 1
        self._meter.worker_blocked(time.monotonic() - started)

    async def _no_longer_ahead(self) -> None:
        """A group started is gone from ahead (taken by a batch, or never made): a worker may start."""
        async with self._policy_updated:
            self._ahead -= 1
            self._policy_updated.notify_all()

    async def _rollout_worker(self, index: int) -> None:
        try:
            await self._roll_out_until_retired(index)
        finally:
            self._live_workers -= 1

    async def _roll_out_until_retired(self, index: int) -> None:
        # Autotune lowers the count by retiring the highest-numbered workers between rollouts.
        while not self._done and index < self.num_rollout_workers:
            await self._start_rollout()
            more, scenario = await self._next_scenario()
            if not more or self._done:
                await self._no_longer_ahead()
                return
            version = self.policy_version
            try:
                group = await self.rollout_fn(self.model, scenario, self.config)
            except LocalServingUnavailableError:
                raise
            except Exception as exc:  # one failed scenario is not the end of the run (as ART)...
                await self._no_longer_ahead()
                if self._is_local_serving_down(exc):  # ...unless every rollout will fail alike
                    raise LocalServingUnavailableError(
                        f"the LocalBackend's inference became unreachable ({exc!r}): the run stops"
                        " instead of counting every rollout as failed"
                    ) from exc
                tqdm.write(f"rollout failed: {exc!r}")
                continue
            for trajectory in group:
                if trajectory.initial_policy_version is None:
                    trajectory.initial_policy_version = version
                trajectory.final_policy_version = self.policy_version
            group.metadata.setdefault("policy_version", version)
            started = time.monotonic()
            await self._queue.put(group)
            self._meter.worker_blocked(time.monotonic() - started)

    def _is_local_serving_down(self, exc: Exception) -> bool:
        """A rollout could not connect to the inference a LocalBackend started here."""
        if getattr(self.backend, "stack", None) is None:
            return False
        return is_connection_failure(exc)

    def _add_workers(self) -> None:
        """Start workers up to ``num_rollout_workers`` (at the start, and when autotune raises it)."""
        while self._live_workers < self.num_rollout_workers and self._workers_open and not self._done:
            self._live_workers += 1
            self._workers.create_task(self._rollout_worker(self._live_workers - 1))

    async def _rollout_stage(self) -> None:
        async with asyncio.TaskGroup() as workers:
            self._workers, self._workers_open = workers, True
            self._add_workers()
        self._workers_open = False  # every worker is done: none may be added to a closed group
        await self._queue.put(None)  # the scenarios ran out: training takes what is left

    async def _collect_batch(self, step: int) -> tuple[list[TrajectoryGroup], bool]:
        """At least ``min_batch_size`` fresh, informative groups (fewer at the end), at most the max."""
        batch: list[TrajectoryGroup] = []
        ended = False
        started, depth, taken, stale = time.monotonic(), self._queue.qsize(), 0, 0
        while len(batch) < self.max_batch_size:
            if len(batch) >= self.min_batch_size and self._queue.empty():
                break
            group = await self._queue.get()
            if group is None:
                ended = True
                break
            await self._no_longer_ahead()
            self._pbar.update(1)
            taken += 1
            if step - int(group.metadata.get("policy_version", step)) > self.max_steps_off_policy:
                self.discarded_stale += 1
                stale += 1
                continue
            if len({t.reward for t in group}) < 2:
                self.discarded_equal += 1
                self._equal_in_a_row += 1
                if self._equal_in_a_row >= self.discard_limit:
                    raise PolicyCollapsed(
                        f"{self._equal_in_a_row} groups in a row had all-equal rewards: the policy"
                        " collapsed (nothing left to learn from)"
                    )
                continue
            self._equal_in_a_row = 0
            batch.append(group)
        ages = [(step - int(g.metadata.get("policy_version", step)), len(g)) for g in batch]
        self._meter.batch_collected(
            wait_s=time.monotonic() - started, taken=taken, stale=stale, ages=ages, queue_depth=depth
        )
        return batch, ended

    async def _training_stage(self) -> None:
        first = step = self.next_training_step
        self._equal_in_a_row = 0
        last_log = time.monotonic()
        try:
            while self.max_steps is None or step - first < self.max_steps:
                batch, ended = await self._collect_batch(step)
                if batch:
                    async with self._policy_updated:
                        self.next_training_step = step + 1
                        self._policy_updated.notify_all()
                    result = await self.backend.train(
                        self.model,
                        batch,
                        max_steps_off_policy=self.max_steps_off_policy,
                        **self.train_kwargs,
                    )
                    step = result.step
                    metrics = {
                        **result.metrics,
                        **self._meter.step_metrics(result.metrics, self.num_rollout_workers),
                        "offpolicy/discarded_stale_groups": float(self.discarded_stale),
                        "data/discarded_equal_reward_groups": float(self.discarded_equal),
                        "data/step_num_groups": float(len(batch)),
                    }
                    await self.model.log(batch, split="train", step=step, metrics=metrics)
                    self._write_state(step)
                    self._tune(step - first)
                    async with self._policy_updated:
                        self.policy_version = step
                        self._policy_updated.notify_all()
                    if time.monotonic() - last_log >= self.log_interval_seconds:
                        tqdm.write(f"step {step}: reward {metrics.get('reward_mean', float('nan')):.3f}")
                        last_log = time.monotonic()
                    every = self.eval_every_n_steps
                    if self.eval_fn is not None and every and step % every == 0:
                        await self._evaluate(step)
                if ended:
                    return
        finally:
            async with self._policy_updated:
                self._done = True
                self._policy_updated.notify_all()

    def _tune(self, steps_done: int) -> None:
        """Every ``window_steps`` steps after the warm-up, move the worker count (online autotune)."""
        tune = self.autotune
        if tune is None:
            return
        if steps_done <= tune.warmup_ignore_steps:
            self._meter.take_window()  # warm-up steps are not part of the first window
            return
        if (steps_done - tune.warmup_ignore_steps) % tune.window_steps:
            return
        decision = next_rollout_workers(self.num_rollout_workers, self._meter.take_window(), tune)
        self.autotune_decisions.append((steps_done, decision.workers, decision.action, decision.reason))
        if decision.workers != self.num_rollout_workers:
            moved = f"{self.num_rollout_workers} -> {decision.workers}"
            tqdm.write(f"autotune: {moved} rollout workers ({decision.reason})")
            self.num_rollout_workers = decision.workers
            self._add_workers()

    async def _evaluate(self, step: int) -> None:
        if self.eval_fn is None:  # callers ask only when there is one
            return
        groups = await self.eval_fn(self.model, step, self.config)
        if groups:
            await self.model.log(groups, split="val", step=step)


_END = object()
