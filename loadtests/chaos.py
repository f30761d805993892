"""Chaos: every service SIGKILLed at random moments of a training run, then checked for losses.

What runs: ``artery.LocalBackend`` under a temporary directory (nats-server, PostgreSQL, the
collector, reward, publisher and trainer, and one inference replica of the tiny model, all real
child processes) and, in this process, an agent that trains on the half-alphabet task: each round
gathers ``--groups-per-step`` groups of ``--group-size`` rollouts through the model's OpenAI
endpoint, then calls ``model.train()`` on them (which publishes the groups).

Meanwhile a chaos task follows a schedule drawn from ``--seed`` (printed before the run): every
service in a shuffled order, ``--kills-per-service`` times, each after a random gap, killed with
SIGKILL at a random moment of a phase of the round (``rollouts`` or ``train``) and restarted
after a random pause. The trainer and the publisher are killed during a ``train()`` call (they
are idle otherwise, and killing an idle process tests only that it starts again); the inference
replica first during rollouts (completions in flight fail and are retried), the collector and the
reward service in either phase. The run goes on until at least ``--trajectories`` trajectories
and ``--steps`` steps are done, every kill has happened and one full round has run after the last
restart.

With ``--max-steps-off-policy K`` the run is asynchronous: each round's step trains while the next
round samples from a replica that is never paused, and the trainer keeps trajectories at most K
steps stale; the checks are the same.

The agent retries a completion that fails while the replica is down (``art.retry`` on connection
errors and 5xx). The replica listens on a fixed port, so a restarted one is found at the same URL.
Timeouts are short so that redeliveries come within seconds: ack waits of 5-10 s, a pause lease of
4 s (``CHAOS_ENV``).

Checked at the end (each a line of the summary, all required for ``ok``):

- no trajectory lost: every group the agent published is in PostgreSQL;
- none stored twice: each group has exactly as many trajectory rows as it had trajectories, and
  PostgreSQL holds no group the agent did not publish (ids are primary keys: never duplicated);
- training resumed from the last checkpoint: ``training_steps`` holds steps 1..N, one per
  ``train()`` call, which returned them in that order; the registry's step is N; after each
  trainer kill the restarted trainer loaded the last step saved on disk when it was killed (K),
  and the next step it trained was K + 1 (or K again, for the request it had saved but not
  recorded);
- no inference replica left paused: ``/health`` says ``ok`` and the registry says not paused;
- nothing dead-lettered, no rollout given up.

Long module: one scenario, read top to bottom: the kill schedule, the agent, the kills, the checks
afterwards, the result and its table. What every benchmark shares is ``loadtests/harness.py``.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import random
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace

import asyncpg
import httpx
import openai

import artery as art
from artery.services.trainer.checkpoints import latest_step
from artery.services.trainer.settings import TrainerSettings
from artery.shared import subjects
from artery.shared.control_client import live_replicas
from artery.shared.models import TINY
from artery.testing.agents import half_alphabet_rollout
from loadtests import harness
from loadtests.harness import argv_of, load_average, machine, report, stopping, table

PROJECT = "chaos"
MODEL = "agent"
MAX_TOKENS = 8
SERVICES = ("collector", "reward", "publisher", "trainer", "inference")
#: Services killed during a ``train()`` call; the inference replica first during rollouts; the
#: others (and later kills of the replica) in a phase drawn at random.
TRAIN_PHASE_ONLY = ("trainer", "publisher")
PHASES = ("rollouts", "train")
INFERENCE = f"inference-{PROJECT}-{MODEL}"
#: Short timeouts, so that what a crash leaves behind is redelivered or expires in seconds.
CHAOS_ENV = {
    "ARTERY_COLLECTOR_ACK_WAIT_S": "5",
    "ARTERY_REWARD_ACK_WAIT_S": "5",
    "ARTERY_PUBLISHER_ACK_WAIT_S": "5",
    "ARTERY_TRAINER_ACK_WAIT_S": "10",
    "ARTERY_TRAINER_PAUSE_LEASE_S": "4",
    "ARTERY_TRAINER_PAUSE_TIMEOUT_S": "5",
    "ARTERY_TRAINER_TORCH_THREADS": "1",
}
#: Rollout retries: 0.5 s, then x1.5 each time (about 85 s in all, longer than a restart).
RETRY_ATTEMPTS, RETRY_DELAY_S, RETRY_BACKOFF = 12, 0.5, 1.5
#: How long the moment of a kill waits for its phase to come before killing anyway, and how many
#: times a phase that ended too soon is waited for again.
PHASE_WAIT_S, PHASE_TRIES = 60.0, 4


@dataclass
class Config:
    trajectories: int
    steps: int
    groups_per_step: int
    group_size: int
    kills_per_service: int
    gap_s: tuple[float, float]
    seed: int
    learning_rate: float
    base_model: str
    timeout_s: float
    output: Path
    #: None: synchronous steps; K: asynchronous, trajectories at most K steps stale are trained.
    max_steps_off_policy: int | None = None


@dataclass
class PlannedKill:
    service: str
    gap_s: float  # after the previous kill's restart (or the start of the run)
    phase: str  # rollouts or train: what the agent is doing when the kill lands
    phase_delay_s: float  # how far into that phase
    down_s: float  # how long the service stays dead before it is restarted


def plan(config: Config) -> list[PlannedKill]:
    """The kill schedule, drawn from the seed alone."""
    rng = random.Random(config.seed)
    order = [s for s in SERVICES for _ in range(config.kills_per_service)]
    rng.shuffle(order)
    kills = []
    for service in order:
        if service in TRAIN_PHASE_ONLY:
            phase = "train"
        elif service == "inference" and not any(k.service == "inference" for k in kills):
            phase = "rollouts"  # completions in flight fail: the agent must retry them
        else:
            phase = rng.choice(PHASES)
        kills.append(
            PlannedKill(
                service=service,
                gap_s=round(rng.uniform(*config.gap_s), 2),
                phase=phase,
                # train() lasts 1-3 s here; a round's rollouts about as long.
                phase_delay_s=round(rng.uniform(0.0, 1.2 if phase == "train" else 0.8), 2),
                down_s=round(rng.uniform(0.0, 1.0), 2),
            )
        )
    return kills


@dataclass
class Kill:
    service: str
    planned: PlannedKill
    at_s: float = 0.0  # since the workload started
    pid: int = 0
    phase: str = ""  # what the agent was doing when the kill landed
    round: int = 0
    restarted_at_s: float = 0.0
    down_s: float = 0.0  # kill until the restarted process was ready
    #: The trainer only: the last complete step on disk when it was killed, where it resumed
    #: from, and the first step it trained afterwards.
    last_saved: int | None = None
    #: Whether the replica was paused (by the trainer's step) just before the kill.
    replica_paused: bool | None = None
    resumed_from: int | None = None
    next_step: int | None = None
    log_offset: int = 0


@dataclass
class Workload:
    """What the agent did, read by the chaos task (the phase) and by the checks (the ids)."""

    started: float = field(default_factory=time.monotonic)
    phase: str = "starting"
    round: int = 0
    phase_events: dict[str, asyncio.Event] = field(default_factory=dict)
    published: dict[str, int] = field(default_factory=dict)  # group id -> trajectories
    steps: list[int] = field(default_factory=list)
    train_s: list[float] = field(default_factory=list)
    rollouts: int = 0
    retries: int = 0
    retry_errors: dict[str, int] = field(default_factory=dict)
    rollouts_failed: int = 0
    train_failures: list[str] = field(default_factory=list)

    def enter(self, phase: str) -> None:
        self.phase = phase
        for name, event in self.phase_events.items():
            event.set() if name == phase else event.clear()

    def elapsed(self) -> float:
        return time.monotonic() - self.started


class RecordingBackend(art.LocalBackend):
    """A ``LocalBackend`` that keeps the id and size of every group it publishes."""

    workload: Workload

    async def publish(self, model, groups, *, split: str = "train") -> list[str]:
        groups = list(groups)
        ids = await super().publish(model, groups, split=split)
        for group_id, group in zip(ids, groups, strict=True):
            self.workload.published[group_id] = len(group.trajectories)
        return ids


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the agent ------------------------------------------------------------------------------


async def gather(model: art.TrainableModel, config: Config, workload: Workload) -> list[art.TrajectoryGroup]:
    def on_retry(exc: BaseException, attempt: int) -> None:
        workload.retries += 1
        name = type(exc).__name__
        workload.retry_errors[name] = workload.retry_errors.get(name, 0) + 1

    @art.retry(
        max_attempts=RETRY_ATTEMPTS,
        delay=RETRY_DELAY_S,
        backoff_factor=RETRY_BACKOFF,
        exceptions=(openai.APIConnectionError, openai.APITimeoutError, openai.InternalServerError),
        on_retry=on_retry,
    )
    async def rollout() -> art.Trajectory:
        return await half_alphabet_rollout(model, max_tokens=MAX_TOKENS)

    groups = await asyncio.gather(
        *(
            art.TrajectoryGroup(rollout() for _ in range(config.group_size))
            for _ in range(config.groups_per_step)
        )
    )
    workload.rollouts += sum(len(g.trajectories) for g in groups)
    workload.rollouts_failed += sum(len(g.exceptions) for g in groups)
    return [g for g in groups if g.trajectories]


async def agent(
    model: art.TrainableModel, config: Config, workload: Workload, chaos_done: asyncio.Event
) -> None:
    """Rounds of rollouts and a training step until the run has done enough, after the chaos.

    Synchronous mode: a round samples, then trains (the replica paused). Asynchronous mode
    (``--max-steps-off-policy``): a round's step trains while the next round samples from the
    replica, which is never paused; one step is in flight at a time, as the trainer takes
    requests one at a time anyway.
    """
    overlapped = config.max_steps_off_policy is not None
    training: asyncio.Task | None = None
    rounds_after_chaos = 0

    async def train(groups: list[art.TrajectoryGroup], round_: int) -> None:
        workload.enter("train")
        started = time.monotonic()
        try:
            result = await model.train(
                groups,
                config=art.TrainConfig(learning_rate=config.learning_rate),
                max_steps_off_policy=config.max_steps_off_policy,
                timeout_s=600,
            )
        except Exception as exc:  # recorded: a failed step fails the run's checks
            workload.train_failures.append(f"round {round_}: {exc!r}")
        else:
            workload.steps.append(result.step)
            workload.train_s.append(time.monotonic() - started)
        workload.enter("rollouts" if overlapped else "between")
        print(
            f"  round {round_}: {sum(len(g.trajectories) for g in groups)} trajectories, "
            f"step {workload.steps[-1] if workload.steps else '-'}, t={workload.elapsed():.1f}s",
            flush=True,
        )

    while True:
        trajectories = sum(workload.published.values())
        if (
            len(workload.steps) >= config.steps
            and trajectories >= config.trajectories
            and chaos_done.is_set()
            and rounds_after_chaos >= 1
        ):
            break
        after_chaos = chaos_done.is_set()
        workload.round += 1
        if training is None:  # while a step trains, the phase stays "train" for the kills
            workload.enter("rollouts")
        groups = await gather(model, config, workload)
        if training is not None:
            await training
        training = asyncio.create_task(train(groups, workload.round))
        if not overlapped:
            await training
            training = None
        rounds_after_chaos += after_chaos
    if training is not None:
        await training


# --- the chaos ------------------------------------------------------------------------------


async def chaos(
    backend: RecordingBackend,
    kills: list[PlannedKill],
    workload: Workload,
    settings: TrainerSettings,
    record,
    done: asyncio.Event,
) -> list[Kill]:
    stack = backend.stack
    out: list[Kill] = []
    try:
        for planned in kills:
            await asyncio.sleep(planned.gap_s)
            await land_in_phase(workload, planned)
            name = INFERENCE if planned.service == "inference" else planned.service
            process = stack.processes[name]
            kill = Kill(service=planned.service, planned=planned, pid=process.proc.pid)
            kill.phase, kill.round = workload.phase, workload.round
            if planned.service == "trainer":  # mid-step when the replica is paused
                kill.replica_paused = await replica_paused(backend)
            kill.at_s = workload.elapsed()
            await asyncio.to_thread(stack.kill_service, name)
            if planned.service == "trainer":  # the dead trainer can write nothing more
                kill.last_saved = latest_step(settings, record)
            print(
                f"  KILL {planned.service} (pid {kill.pid}) at t={kill.at_s:.1f}s, "
                f"round {kill.round} phase {kill.phase}"
                + (f", last saved step {kill.last_saved}" if kill.last_saved is not None else "")
                + (", replica paused (mid-step)" if kill.replica_paused else ""),
                flush=True,
            )
            await asyncio.sleep(planned.down_s)
            restarted = stack.start_service(name)
            restarted.restarts += 1
            kill.log_offset = restarted._log_offset
            await asyncio.to_thread(restarted.wait_ready, 180.0)
            kill.restarted_at_s = workload.elapsed()
            kill.down_s = kill.restarted_at_s - kill.at_s
            print(f"  restarted {planned.service}: ready {kill.down_s:.1f}s after the kill", flush=True)
            out.append(kill)
    finally:
        done.set()
    return out


async def land_in_phase(workload: Workload, planned: PlannedKill) -> None:
    """Wait for the kill's phase, then ``phase_delay_s`` into it. A phase that ended before the
    delay was over is waited for again, with half the delay (a few times, then it is given up:
    the kill lands in whatever phase it is, and the result says which)."""
    delay = planned.phase_delay_s
    for _ in range(PHASE_TRIES):
        try:
            await asyncio.wait_for(workload.phase_events[planned.phase].wait(), PHASE_WAIT_S)
        except TimeoutError:
            return
        round_ = workload.round
        await asyncio.sleep(delay)
        if workload.phase == planned.phase and workload.round == round_:
            return
        delay /= 2


async def replica_paused(backend: RecordingBackend) -> bool | None:
    """What the replica's ``/health`` says (None: it did not answer)."""
    port = backend.stack.processes[INFERENCE].env["ARTERY_INFERENCE_PORT"]
    try:
        async with httpx.AsyncClient(timeout=1.0) as http:
            return (await http.get(f"http://127.0.0.1:{port}/health")).json()["status"] == "paused"
    except (httpx.HTTPError, ValueError, KeyError):
        return None


#: How long the checks wait for the publisher to record the last step (it takes well under a
#: second; a publisher that was killed restarts within the run's own readiness waits).
PUBLISH_WAIT_S = 60.0


def trainer_resumes(log_path: Path, kills: list[Kill]) -> None:
    """Fill ``resumed_from`` and ``next_step`` of each trainer kill from the restarted trainer's log."""
    trainer_kills = sorted((k for k in kills if k.service == "trainer"), key=lambda k: k.log_offset)
    data = log_path.read_bytes()
    for i, kill in enumerate(trainer_kills):
        end = trainer_kills[i + 1].log_offset if i + 1 < len(trainer_kills) else len(data)
        for line in data[kill.log_offset : end].splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if entry.get("project") != PROJECT or entry.get("model") != MODEL:
                continue
            if kill.resumed_from is None and entry.get("event") == "resuming":
                kill.resumed_from = int(entry["step"])
            elif kill.resumed_from is None and entry.get("event") == "new adapter":
                kill.resumed_from = 0
            elif kill.next_step is None and entry.get("event") == "trained":
                kill.next_step = int(entry["step"])


# --- the checks -----------------------------------------------------------------------------


async def verify(backend: RecordingBackend, model: art.TrainableModel, workload: Workload, kills, lease_s):
    conn = await asyncpg.connect(backend.database_url)
    try:
        rows = await conn.fetch(
            "SELECT g.id, g.num_trajectories, count(t.idx) AS stored FROM trajectory_groups g"
            " LEFT JOIN trajectories t ON t.group_id = g.id"
            " WHERE g.project = $1 AND g.model = $2 GROUP BY g.id, g.num_trajectories",
            PROJECT,
            MODEL,
        )
        steps = await conn.fetch(
            "SELECT step, request_id FROM training_steps WHERE project = $1 AND model = $2 ORDER BY step",
            PROJECT,
            MODEL,
        )
        # train() returns once a replica serves the new step, and a replica loads a saved step
        # (checkpoint.saved, from the trainer-state store) before the publisher has put it in
        # the adapters bucket and recorded it: wait for the publisher's row of the last step.
        last_step = len(workload.steps)
        deadline = time.monotonic() + PUBLISH_WAIT_S
        while True:
            published_steps = await conn.fetch(
                "SELECT step FROM checkpoints WHERE project = $1 AND model = $2 AND published_at IS NOT NULL"
                " ORDER BY step",
                PROJECT,
                MODEL,
            )
            if (published_steps and published_steps[-1]["step"] >= last_step) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
    finally:
        await conn.close()
    stored = {r["id"]: (r["num_trajectories"], r["stored"]) for r in rows}
    published = workload.published
    lost = sorted(set(published) - set(stored))
    unexpected = sorted(set(stored) - set(published))
    miscounted = sorted(
        g for g, n in published.items() if g in stored and stored[g] != (n, n)
    )  # fewer rows: lost; more: stored twice (the primary key forbids it, this checks it)
    step_numbers = [r["step"] for r in steps]
    n = len(workload.steps)
    kv_step = await model.get_step()

    js = await backend._js()
    # A kill may have left a lease behind: it ends within the lease. Wait that long at most.
    deadline = time.monotonic() + lease_s + 5
    while True:
        replicas = await live_replicas(js, PROJECT, MODEL)
        async with httpx.AsyncClient(timeout=10) as http:
            health = (await http.get(model.inference_base_url.removesuffix("/v1") + "/health")).json()
        paused = [r.replica_id for r in replicas if r.paused] + (
            ["/health"] if health["status"] != "ok" else []
        )
        if not paused or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    dlq = (await js.stream_info(subjects.DLQ.name)).state.messages

    trainer_kills = [k for k in kills if k.service == "trainer"]
    resumed_ok = all(
        k.resumed_from == k.last_saved and k.next_step in (k.last_saved, k.last_saved + 1)
        for k in trainer_kills
    )
    checks = {
        "no_trajectory_lost": not lost and not miscounted,
        "none_stored_twice": not unexpected and not miscounted and len(stored) == len(published),
        "steps_1_to_n": step_numbers == list(range(1, n + 1)) and workload.steps == step_numbers,
        "registry_step_is_last": kv_step == (step_numbers[-1] if step_numbers else 0),
        "trainer_resumed_from_last_checkpoint": resumed_ok and bool(trainer_kills),
        "latest_step_published": bool(published_steps) and published_steps[-1]["step"] == n,
        "no_replica_paused": not paused and bool(replicas),
        "nothing_dead_lettered": dlq == 0,
        "no_rollout_given_up": workload.rollouts_failed == 0,
        "no_train_call_failed": not workload.train_failures,
        "every_service_killed": {k.service for k in kills} == set(SERVICES),
    }
    details = {
        "groups_published": len(published),
        "groups_stored": len(stored),
        "trajectories_published": sum(published.values()),
        "trajectories_stored": sum(s for _, s in stored.values()),
        "lost_groups": lost[:20],
        "unexpected_groups": unexpected[:20],
        "miscounted_groups": miscounted[:20],
        "training_steps": step_numbers,
        "train_returned_steps": workload.steps,
        "registry_step": kv_step,
        "published_steps": [r["step"] for r in published_steps],
        "replicas": [{"replica_id": r.replica_id, "paused": r.paused} for r in replicas],
        "health": health["status"],
        "dead_letters": dlq,
    }
    return checks, details


# --- the run --------------------------------------------------------------------------------


async def run(config: Config, home: Path, kills_planned: list[PlannedKill]) -> dict:
    load_before = load_average()
    workload = Workload()
    workload.phase_events = {p: asyncio.Event() for p in PHASES}
    port = free_port()
    backend = RecordingBackend(
        path=home / "artery",
        inference_env={"ARTERY_INFERENCE_PORT": str(port), "ARTERY_INFERENCE_TORCH_THREADS": "1"},
    )
    backend.workload = workload
    backend.stack.extra_env.update(CHAOS_ENV)
    model = art.TrainableModel(name=MODEL, project=PROJECT, base_model=config.base_model, base_path=str(home))
    chaos_done = asyncio.Event()
    kills: list[Kill] = []
    async with stopping(backend):
        started = time.monotonic()
        await model.register(backend)  # starts the stack and the replica
        startup_s = time.monotonic() - started
        print(f"stack and replica up in {startup_s:.1f}s", flush=True)
        settings = TrainerSettings(checkpoint_dir=str(backend.stack.home / "checkpoints"))
        record = SimpleNamespace(project=PROJECT, name=MODEL)  # what latest_step reads
        workload.started = time.monotonic()
        agent_task = asyncio.create_task(agent(model, config, workload, chaos_done))
        chaos_task = asyncio.create_task(
            chaos(backend, kills_planned, workload, settings, record, chaos_done)
        )
        done, pending = await asyncio.wait(
            {agent_task, chaos_task}, timeout=config.timeout_s, return_when=asyncio.FIRST_EXCEPTION
        )
        for task in pending:
            task.cancel()
        for task in done:
            task.result()  # raises what went wrong
        if pending:
            raise TimeoutError(f"the run did not finish within {config.timeout_s:.0f}s")
        kills = chaos_task.result()
        run_s = workload.elapsed()
        trainer_resumes(backend.stack.processes["trainer"].log_path, kills)
        checks, details = await verify(
            backend, model, workload, kills, float(CHAOS_ENV["ARTERY_TRAINER_PAUSE_LEASE_S"])
        )
    return {
        "benchmark": "chaos",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": machine(load_before),
        "config": {
            "min_trajectories": config.trajectories,
            "min_steps": config.steps,
            "groups_per_step": config.groups_per_step,
            "group_size": config.group_size,
            "kills_per_service": config.kills_per_service,
            "gap_s": list(config.gap_s),
            "seed": config.seed,
            "learning_rate": config.learning_rate,
            "base_model": config.base_model,
            "max_steps_off_policy": config.max_steps_off_policy,
            "env": CHAOS_ENV,
            "rollout_retry": {"attempts": RETRY_ATTEMPTS, "delay_s": RETRY_DELAY_S, "backoff": RETRY_BACKOFF},
        },
        "schedule": [asdict(k) for k in kills_planned],
        "startup_s": round(startup_s, 2),
        "run_s": round(run_s, 2),
        "rounds": workload.round,
        "rollouts": workload.rollouts,
        "rollout_retries": workload.retries,
        "rollout_retry_errors": workload.retry_errors,
        "train_s_median": round(statistics.median(workload.train_s), 3) if workload.train_s else None,
        "train_s_max": round(max(workload.train_s), 3) if workload.train_s else None,
        "kills": [kill_row(kill) for kill in kills],
        "details": details,
        "checks": checks,
        "ok": all(checks.values()),
    }


def kill_row(kill: Kill) -> dict:
    row = {
        "service": kill.service,
        "pid": kill.pid,
        "round": kill.round,
        "phase": kill.phase,
        "at_s": round(kill.at_s, 2),
        "restarted_at_s": round(kill.restarted_at_s, 2),
        "down_s": round(kill.down_s, 2),
    }
    if kill.service == "trainer":
        row.update(
            replica_paused=kill.replica_paused,
            last_saved=kill.last_saved,
            resumed_from=kill.resumed_from,
            next_step=kill.next_step,
        )
    return row


def render_schedule(kills: list[PlannedKill], seed: int) -> str:
    rows = [("#", "service", "after s", "phase", "into phase s", "down s")]
    for i, k in enumerate(kills, 1):
        rows.append(
            (str(i), k.service, f"{k.gap_s:.2f}", k.phase, f"{k.phase_delay_s:.2f}", f"{k.down_s:.2f}")
        )
    return "\n".join([f"kill schedule (seed {seed}):", *table(rows, right={0, 2, 4, 5})])


def render(result: dict) -> str:
    c, d = result["config"], result["details"]
    rows = [("service", "killed at", "round", "phase", "pid", "ready after", "trainer")]
    for k in result["kills"]:
        trainer = (
            f"{'mid-step (replica paused), ' if k['replica_paused'] else ''}"
            f"last saved {k['last_saved']}, resumed from {k['resumed_from']}, next step {k['next_step']}"
            if k["service"] == "trainer"
            else ""
        )
        rows.append(
            (
                k["service"],
                f"{k['at_s']:.1f} s",
                str(k["round"]),
                k["phase"],
                str(k["pid"]),
                f"{k['down_s']:.1f} s",
                trainer,
            )
        )
    checks = [("check", "outcome")] + [
        (name, "PASS" if ok else "FAIL") for name, ok in result["checks"].items()
    ]
    return "\n".join(
        [
            f"chaos: >= {c['min_trajectories']} trajectories, >= {c['min_steps']} steps, "
            f"{c['groups_per_step']} groups x {c['group_size']} rollouts a round, "
            f"{c['kills_per_service']} kill(s) per service, seed {c['seed']}, "
            + (
                f"asynchronous (at most {c['max_steps_off_policy']} step(s) off policy)"
                if c.get("max_steps_off_policy") is not None
                else "synchronous"
            ),
            f"machine: {result['machine']['cpu_count']} CPUs "
            f"(load {result['machine']['load_average_1m_before']} before); "
            f"stack up in {result['startup_s']:.1f} s, "
            f"run {result['run_s']:.1f} s, {result['rounds']} rounds",
            "",
            *table(rows, right={1, 2, 4, 5}),
            "",
            f"trajectories: {d['trajectories_published']:,} published, {d['trajectories_stored']:,} stored "
            f"({d['groups_published']} groups published, {d['groups_stored']} stored)",
            f"steps: train() returned {d['train_returned_steps']}; training_steps {d['training_steps']}; "
            f"registry step {d['registry_step']}; published {d['published_steps']}",
            f"rollouts: {result['rollouts']:,}, retried {result['rollout_retries']} times "
            f"({', '.join(f'{k} {v}' for k, v in result['rollout_retry_errors'].items()) or 'none'}); "
            f"train() median {result['train_s_median']} s, max {result['train_s_max']} s",
            f"replicas at the end: {d['replicas']}, /health {d['health']}; dead letters: {d['dead_letters']}",
            "",
            *table(checks, right=set()),
            "",
            "OK: nothing lost, nothing doubled, training resumed, inference serving"
            if result["ok"]
            else "FAILED: see the checks above",
        ]
    )


def parse_args(argv: list[str]) -> Config:
    parser = harness.parser("chaos", __doc__, prog="python -m loadtests.chaos")
    parser.add_argument("--trajectories", type=int, default=512, help="at least this many (default 512)")
    parser.add_argument("--steps", type=int, default=3, help="at least this many training steps (default 3)")
    parser.add_argument("--groups-per-step", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--kills-per-service", type=int, default=1)
    parser.add_argument("--gap-min", type=float, default=1.0, help="least seconds between two kills")
    parser.add_argument("--gap-max", type=float, default=5.0, help="most seconds between two kills")
    parser.add_argument("--seed", type=int, default=0, help="draws the kill schedule")
    parser.add_argument("--learning-rate", type=float, default=1e-2)
    parser.add_argument("--base-model", default=TINY, help=f"weights: a directory or {TINY} (default)")
    parser.add_argument("--timeout", type=float, default=900.0, help="longest the run may take, seconds")
    parser.add_argument(
        "--max-steps-off-policy",
        type=int,
        default=None,
        help="asynchronous mode: train while the next round samples, at most this many steps off policy",
    )
    args = parser.parse_args(argv)
    if min(args.trajectories, args.steps, args.groups_per_step, args.group_size, args.kills_per_service) < 1:
        parser.error("--trajectories, --steps, --groups-per-step, --group-size, --kills-per-service: >= 1")
    if not 0 <= args.gap_min <= args.gap_max:
        parser.error("need 0 <= --gap-min <= --gap-max")
    return Config(
        trajectories=args.trajectories,
        steps=args.steps,
        groups_per_step=args.groups_per_step,
        group_size=args.group_size,
        kills_per_service=args.kills_per_service,
        gap_s=(args.gap_min, args.gap_max),
        seed=args.seed,
        learning_rate=args.learning_rate,
        base_model=args.base_model,
        timeout_s=args.timeout,
        output=args.output,
        max_steps_off_policy=args.max_steps_off_policy,
    )


def main(argv: list[str] | None = None) -> dict:
    config = parse_args(argv_of(argv))
    kills = plan(config)
    print(render_schedule(kills, config.seed), flush=True)
    with tempfile.TemporaryDirectory(prefix="artery-chaos-") as home:
        result = asyncio.run(run(config, Path(home), kills))
    report(result, render, config.output)
    return result


if __name__ == "__main__":
    result = main()
    sys.exit(0 if result["ok"] else 1)
