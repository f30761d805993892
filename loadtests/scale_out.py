"""Trainer scale-out benchmark: the same work trained by 1, then by 2 trainer worker processes.

What runs: a private nats-server and PostgreSQL (``artery.ops.stack.Stack``, no services), then,
phase by phase, ``--workers`` trainer processes (``python -m artery.services.trainer``, each
with a checkpoint directory of its own and its own ``ARTERY_TRAINER_WORKER_ID``) sharing the
trainer's durable consumer. No inference replica runs: a step finds nothing to pause and trains.

The work of a phase, the same in every phase: ``--projects`` tenants x ``--models`` models each x
``--steps`` train requests per model, every request naming one stored group of ``--group-size``
plain-text rollouts on ``artery/tiny-random``. The groups are written to PostgreSQL directly (what
the collector would have stored) and the models registered in the models bucket (what
``model.register()`` writes); then every request is published at once, tenant after tenant (the
first tenant's flood is queued before the second tenant's first request: what round-robin over
projects has to undo). Each phase trains models of its own (``w1-m0``, ``w2-m0`` ...), so every
phase starts from step 0.

What is measured, per phase:

- ``steps_per_s``: requests trained / seconds from the first publish to the last answer;
- ``order_violations``: per model, the steps recorded in PostgreSQL (``training_steps``) in the
  order they completed must be 1..N, each once, so must the steps ``checkpoint.saved`` announced
  (one per event id: a redelivery re-announces under the same id), and every ``train.completed``
  must name the step recorded for its request; each position where they are not counts one. A
  step trained from another state than the step before (a worker resuming stale state, two
  workers at once) gives a step number twice or out of order, which PostgreSQL refuses (the
  request is then lost) or this check counts;
- ``lost``: requests never answered (neither ``train.completed`` nor ``train.failed``) before the
  run stalled for ``--stall-s``; ``failed`` and ``answered_more_than_once`` beside it;
- ``overlapping_steps``: consecutive steps of one model whose run times (from each step's
  ``step_total_s``) overlapped, i.e. the model trained on two workers at once;
- ``by_worker`` and ``handoffs``: which worker trained each step (its ``trained`` log line), and
  how often a model's next step ran on another worker than the step before (resumed elsewhere);
- ``tenants``: each project's steps, its share of the trainer while every project still had
  requests waiting, its first step and its longest wait between steps, and its steps per window
  of the run (``--windows``): no tenant starved;
- ``cpu_s``: CPU seconds of the trainers, nats-server, PostgreSQL, this process and the rest of
  the machine (a shared 2-core machine makes ratios within one run the figures that count).

``speedup`` is the 2-worker phase's steps/s over the 1-worker phase's, measured in the same run.

Long module: one benchmark, read top to bottom: the work, a phase, the checks, the result and its
table. What every benchmark shares is ``loadtests/harness.py``.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import itertools
import json
import shutil
import signal
import statistics
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Collection, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import asyncpg
import msgspec
import nats

from artery.ops.stack import Stack
from artery.schemas import (
    CheckpointSaved,
    Message,
    ModelRecord,
    TrainCompleted,
    TrainFailed,
    TrainRequested,
    Trajectory,
    TrajectoryGroupSubmitted,
    new_event_id,
)
from artery.services.collector.store import StoredGroup, write_groups
from artery.shared import bus, subjects
from artery.shared.db import init_connection, migrate_when_ready
from artery.shared.embedded import postgres_bin_dir
from artery.shared.models import TINY
from artery.shared.settings import CommonSettings
from loadtests import harness
from loadtests.harness import CpuMeter, argv_of, load_average, machine, report, table

PROJECTS = ("alpha", "beta", "gamma", "delta")
DEFAULT_STEPS, QUICK_STEPS = 6, 3
#: The tenant of the warm-up models (each worker trains one before a phase's clock starts).
WARMUP_PROJECT = "warmup"
WARMUP_ROUNDS = 5
#: A trainer slow to start (torch imports on a busy machine) fails the run after this.
READY_TIMEOUT_S = 180.0


@dataclass(frozen=True, kw_only=True)
class Config:
    projects: int
    models: int
    steps: int
    group_size: int
    words: int
    workers: tuple[int, ...]
    threads: int
    windows: int
    stall_s: float
    quick: bool
    logs: Path | None
    output: Path


# --------------------------------------------------------------------------- the work


def text_group(project: str, model: str, seed: int, size: int, words: int) -> TrajectoryGroupSubmitted:
    """Plain-text rollouts (the chat-template path) of about ``words`` words, different lengths
    and rewards."""
    return TrajectoryGroupSubmitted(
        id=f"g-{model}-{seed}",
        project=project,
        model=model,
        trajectories=[
            Trajectory(
                messages=[
                    Message(role="user", content=f"Say something about {seed}."),
                    Message(
                        role="assistant", content="abc def " * (words // 2 + (i + seed) % 4), trainable=True
                    ),
                ],
                reward=i / size,
            )
            for i in range(size)
        ],
    )


class Answers:
    """Every ``train.completed`` and ``train.failed``, by request id, with the time each arrived;
    and every ``checkpoint.saved`` (its id and step), by model, in the order they arrived."""

    def __init__(self, nc: nats.NATS):
        self.nc = nc
        self.by_request: dict[str, list[tuple[float, TrainCompleted | TrainFailed]]] = defaultdict(list)
        self.saved: dict[tuple[str, str], dict[str, int]] = defaultdict(dict)
        self.progress = asyncio.Event()
        self._subs: list = []
        self._decoders: dict[str, msgspec.json.Decoder] = {
            "completed": msgspec.json.Decoder(TrainCompleted),
            "failed": msgspec.json.Decoder(TrainFailed),
        }
        self._saved_decoder = msgspec.json.Decoder(CheckpointSaved)

    async def __aenter__(self) -> Answers:
        for kind in ("completed", "failed"):
            self._subs.append(await self.nc.subscribe(subjects.train(kind, "*", "*"), cb=self._received))
        self._subs.append(await self.nc.subscribe(subjects.CHECKPOINTS_SAVED, cb=self._saved))
        await self.nc.flush()  # subscribed at the server before any request is published
        return self

    async def __aexit__(self, *exc: object) -> None:
        for sub in self._subs:
            await sub.unsubscribe()

    async def _received(self, msg) -> None:
        event = self._decoders[msg.subject.split(".")[2]].decode(msg.data)
        self.by_request[event.request_id].append((time.monotonic(), event))
        self.progress.set()

    async def _saved(self, msg) -> None:
        event = self._saved_decoder.decode(msg.data)
        # A redelivered request announces its step again under the same id: one entry.
        self.saved[(event.project, event.model)].setdefault(event.id, event.step or 0)

    def answered(self, request_ids: Iterable[str]) -> int:
        return sum(1 for rid in request_ids if self.by_request.get(rid))

    async def wait(self, request_ids: Collection[str], stall_s: float) -> bool:
        """Until every request is answered (True), or none more is for ``stall_s`` (False)."""
        while self.answered(request_ids) < len(request_ids):
            self.progress.clear()
            if self.answered(request_ids) == len(request_ids):
                break
            try:
                await asyncio.wait_for(self.progress.wait(), stall_s)
            except TimeoutError:
                print(f"  stalled: {self.answered(request_ids)}/{len(request_ids)} answered", flush=True)
                return False
        return True


async def store_work(
    js, conn: asyncpg.Connection, config: Config, models: list[tuple[str, str]], steps: int
) -> list[TrainRequested]:
    """Register the models, store their groups; the requests in publish order: tenant after
    tenant, each tenant's models interleaved, each model's steps in order."""
    kv = await js.key_value(subjects.MODELS_BUCKET)
    groups = []
    for project, model in models:
        record = ModelRecord(project=project, name=model, base_model=TINY, trainable=True, step=0)
        await kv.put(subjects.model_key(project, model), msgspec.json.encode(record))
        groups += [text_group(project, model, k, config.group_size, config.words) for k in range(steps)]
    await write_groups(conn, [StoredGroup.of(g, None) for g in groups])
    return [
        TrainRequested(id=new_event_id(), project=project, model=model, group_ids=[f"g-{model}-{k}"])
        for project in dict.fromkeys(p for p, _ in models)
        for k in range(steps)
        for p, model in models
        if p == project
    ]


async def publish(js, requests: list[TrainRequested]) -> None:
    for event in requests:
        await bus.publish_event(js, subjects.train("requested", event.project, event.model), event)


# --------------------------------------------------------------------------- a phase


def start_workers(stack: Stack, config: Config, workers: int) -> list[str]:
    names = []
    for i in range(1, workers + 1):
        name = f"trainer-w{workers}-{i}"
        stack.start_service(
            name,
            service="trainer",
            env={
                "ARTERY_TRAINER_CHECKPOINT_DIR": str(stack.home / "checkpoints" / name),
                "ARTERY_TRAINER_WORKER_ID": name,
                "ARTERY_TRAINER_TORCH_THREADS": str(config.threads),
                "ARTERY_TRAINER_MAX_SEQ_LEN": "128",
                "ARTERY_TRAINER_PAUSE_TIMEOUT_S": "1",
            },
        )
        names.append(name)
    for name in names:
        stack.processes[name].wait_ready(READY_TIMEOUT_S)
    return names


def stop_workers(stack: Stack, names: list[str]) -> dict[str, Path]:
    """Stop the phase's workers (all asked at once: each drains on its own); their logs."""
    processes = [stack.processes.pop(name) for name in names]
    for process in processes:
        process.signal(signal.SIGTERM)
    for process in processes:
        process.stop(timeout=harness.STOP_TIMEOUT_S * 10)
    return {process.name: process.log_path for process in processes}


async def warm_up(
    js, conn: asyncpg.Connection, answers: Answers, stack: Stack, config: Config, names: list[str]
) -> int:
    """Until every worker has trained a step (torch's first passes, the base model read from
    disk: seconds a phase's figure should not hold), one warm-up model per worker at a time; the
    rounds it took."""
    for attempt in range(1, WARMUP_ROUNDS + 1):
        models = [(WARMUP_PROJECT, f"warm-{len(names)}-{attempt}-{i}") for i in range(len(names))]
        requests = await store_work(js, conn, config, models, 1)
        await publish(js, requests)
        await answers.wait([r.id for r in requests], config.stall_s)
        logs = {name: stack.processes[name].log_path for name in names}
        warmed = {worker for (project, _, _), worker in trained_by(logs).items() if project == WARMUP_PROJECT}
        if warmed >= set(names):
            return attempt
    print(f"  warm-up: {sorted(set(names) - warmed)} trained nothing in {WARMUP_ROUNDS} rounds", flush=True)
    return WARMUP_ROUNDS


async def run_phase(
    stack: Stack, nc: nats.NATS, conn: asyncpg.Connection, config: Config, workers: int
) -> dict:
    js = nc.jetstream()
    models = phase_models(config, workers)
    requests = await store_work(js, conn, config, models, config.steps)
    names = await asyncio.to_thread(start_workers, stack, config, workers)
    try:
        async with Answers(nc) as answers:
            warmup_rounds = await warm_up(js, conn, answers, stack, config, names)
            meter = CpuMeter(stack)
            cpu_before = meter.snapshot()
            started = time.monotonic()
            await publish(js, requests)
            await answers.wait([r.id for r in requests], config.stall_s)
            cpu = CpuMeter.delta(cpu_before, meter.snapshot())
    finally:
        logs = await asyncio.to_thread(stop_workers, stack, names)
    rows = await conn.fetch(
        "SELECT request_id, project, model, step, completed_at FROM training_steps"
        " WHERE project <> $2 AND model LIKE $1 ORDER BY completed_at, step",
        f"w{workers}-%",
        WARMUP_PROJECT,
    )
    phase = Phase(
        workers=workers,
        models=models,
        requests={r.id: (r.project, r.model) for r in requests},
        answers={r.id: answers.by_request.get(r.id, []) for r in requests},
        saved={m: list(answers.saved.get(m, {}).values()) for m in models},
        started=started,
    )
    result = summarize(config, phase, rows, trained_by(logs), cpu)
    return {**result, "warmup_rounds": warmup_rounds}


@dataclass
class Phase:
    """One phase's models, requests and what came back."""

    workers: int
    models: list[tuple[str, str]]
    #: request id -> (project, model), in publish order
    requests: dict[str, tuple[str, str]]
    #: request id -> its answers, with the monotonic time each arrived
    answers: dict[str, list[tuple[float, TrainCompleted | TrainFailed]]]
    #: (project, model) -> the steps ``checkpoint.saved`` announced, in order, one per event id
    saved: dict[tuple[str, str], list[int]]
    started: float

    @property
    def last_answer(self) -> float:
        return max((at for answers in self.answers.values() for at, _ in answers), default=self.started)


def phase_models(config: Config, workers: int) -> list[tuple[str, str]]:
    return [(p, f"w{workers}-m{i}") for p in PROJECTS[: config.projects] for i in range(config.models)]


def trained_by(logs: dict[str, Path]) -> dict[tuple[str, str, int], str]:
    """(project, model, step) -> the worker whose log says it trained it."""
    out = {}
    for name, path in logs.items():
        for line in path.read_text(errors="replace").splitlines():
            if '"event": "trained"' not in line:
                continue
            try:
                entry = json.loads(line)
                out[(entry["project"], entry["model"], int(entry["step"]))] = name
            except (ValueError, KeyError):
                continue
    return out


# --------------------------------------------------------------------------- the checks


def summarize(config: Config, phase: Phase, rows: list, workers_of: dict, cpu: dict) -> dict:
    elapsed = max(phase.last_answer - phase.started, 1e-9)
    first_answers = {rid: answers[0] for rid, answers in phase.answers.items() if answers}
    completed = {rid: e for rid, (_, e) in first_answers.items() if isinstance(e, TrainCompleted)}
    failed = [rid for rid, (_, e) in first_answers.items() if isinstance(e, TrainFailed)]
    lost = [rid for rid in phase.requests if not phase.answers.get(rid)]
    twice = [rid for rid, answers in phase.answers.items() if len(answers) > 1]

    order = check_order(phase, rows, completed)
    tenants = tenant_shares(config, phase, first_answers, elapsed)
    by_worker = Counter(workers_of.get((p, m, s), "unknown") for p, m, s in order["recorded"])
    handoffs = sum(
        1
        for (p, m, s) in order["recorded"]
        if s > 1 and (p, m, s - 1) in workers_of and workers_of.get((p, m, s)) != workers_of[(p, m, s - 1)]
    )
    step_totals = [e.metrics["step_total_s"] for e in completed.values() if "step_total_s" in e.metrics]
    return {
        "steps": len(completed),
        "requests": len(phase.requests),
        "elapsed_s": round(elapsed, 2),
        "steps_per_s": round(len(completed) / elapsed, 3),
        "step_total_s_median": round(statistics.median(step_totals), 3) if step_totals else None,
        # How much of the phase the workers spent in steps: 1.0 per worker that never waited.
        "steps_running_mean": round(sum(step_totals) / elapsed, 2),
        "order_violations": order["violations"],
        "order_problems": order["problems"][:20],
        "overlapping_steps": order["overlaps"],
        "lost": len(lost),
        "failed": len(failed),
        "failed_errors": sorted({first_answers[rid][1].error[:200] for rid in failed})[:5],  # type: ignore[union-attr]
        "answered_more_than_once": len(twice),
        "by_worker": dict(sorted(by_worker.items())),
        "handoffs": handoffs,
        "tenants": tenants,
        "cpu_s": cpu,
    }


def check_order(phase: Phase, rows: list, completed: dict[str, TrainCompleted]) -> dict:
    """Per model: the recorded steps, in completion order, are 1..N, each once; so are the steps
    ``checkpoint.saved`` announced; every answer names the step recorded for its request. Apart:
    consecutive steps whose run times overlapped."""
    problems: list[str] = []
    violations = 0
    recorded: list[tuple[str, str, int]] = []
    per_model: dict[tuple[str, str], list] = defaultdict(list)
    for row in rows:
        per_model[(row["project"], row["model"])].append(row)
    for project, model in phase.models:
        steps = [row["step"] for row in per_model[(project, model)]]
        for position, step in enumerate(steps, start=1):
            recorded.append((project, model, step))
            if step != position:
                violations += 1
                problems.append(f"{project}/{model}: step {step} completed in position {position}")
        if len(set(steps)) != len(steps):  # PostgreSQL refuses this; counted should it not
            violations += len(steps) - len(set(steps))
            problems.append(f"{project}/{model}: a step recorded twice: {steps}")
        announced = phase.saved.get((project, model), [])
        for position, step in enumerate(announced, start=1):
            if step != position:  # a step announced twice (two workers trained it) or skipped
                violations += 1
                problems.append(f"{project}/{model}: checkpoint.saved step {step} in position {position}")
    step_of = {row["request_id"]: row["step"] for row in rows}
    for rid, event in completed.items():
        if step_of.get(rid) != event.step:
            violations += 1
            problems.append(
                f"{event.project}/{event.model}: answered step {event.step}, recorded {step_of.get(rid)}"
            )
    overlaps = 0
    spans: dict[tuple[str, str], list[tuple[int, float, float]]] = defaultdict(list)
    for event in completed.values():
        total = event.metrics.get("step_total_s")
        if total is not None and event.step is not None:
            end = event.time.timestamp()
            spans[(event.project, event.model)].append((event.step, end - total, end))
    for model_spans in spans.values():
        model_spans.sort()
        for (_, _, end), (step, start, _) in itertools.pairwise(model_spans):
            if start < end:
                overlaps += 1
                problems.append(f"step {step} started {end - start:.3f}s before the step before ended")
    return {"violations": violations, "problems": problems, "overlaps": overlaps, "recorded": recorded}


def tenant_shares(config: Config, phase: Phase, first_answers: dict, elapsed: float) -> dict:
    """Each project's steps over time: its share while every project had requests left, its first
    step and longest wait, the most steps of other tenants in a row while it had requests left,
    and its steps in each of ``windows`` equal parts of the run.

    Starved: some tenant saw more than ``2 x workers x (tenants - 1)`` other tenants' steps in a
    row while it waited (round-robin gives each other tenant about one step per worker between
    two of its own; first come, first served gives the whole flood queued before it)."""
    projects = PROJECTS[: config.projects]
    done = sorted(
        (at - phase.started, phase.requests[rid][0])
        for rid, (at, event) in first_answers.items()
        if isinstance(event, TrainCompleted)
    )
    times: dict[str, list[float]] = {p: [t for t, q in done if q == p] for p in projects}
    wanted = {p: sum(1 for q, _ in phase.requests.values() if q == p) for p in projects}
    # Contended until the first project has had all its requests answered.
    done_at = [values[-1] for p, values in times.items() if values and len(values) == wanted[p]]
    contended_until = min(done_at) if len(done_at) == len(projects) else elapsed
    in_contention = {p: sum(1 for t in values if t <= contended_until) for p, values in times.items()}
    total = sum(in_contention.values()) or 1
    in_a_row = dict.fromkeys(projects, 0)
    most_in_a_row = dict.fromkeys(projects, 0)
    trained = dict.fromkeys(projects, 0)
    for _, project in done:
        trained[project] += 1
        in_a_row[project] = 0
        for other in projects:
            if other != project and trained[other] < wanted[other]:
                in_a_row[other] += 1
                most_in_a_row[other] = max(most_in_a_row[other], in_a_row[other])
    width = elapsed / config.windows
    out: dict[str, Any] = {}
    for p in projects:
        values = times[p]
        gaps = [b - a for a, b in itertools.pairwise([0.0, *values])]
        windows = [0] * config.windows
        for t in values:
            windows[min(config.windows - 1, int(t / width))] += 1
        out[p] = {
            "steps": len(values),
            "share_while_contended": round(in_contention[p] / total, 3),
            "first_step_s": round(values[0], 2) if values else None,
            "longest_wait_s": round(max(gaps), 2) if gaps else None,
            "others_steps_in_a_row": most_in_a_row[p],
            "steps_per_window": windows,
        }
    bound = 2 * phase.workers * (len(projects) - 1)
    return {
        "contended_s": round(contended_until, 2),
        "fair_share": round(1 / len(projects), 3),
        "min_share_while_contended": min(t["share_while_contended"] for t in out.values()),
        "starved_bound": bound,
        "starved": any(t["steps"] == 0 or t["others_steps_in_a_row"] > bound for t in out.values()),
        "projects": out,
    }


# --------------------------------------------------------------------------- the run


def trainer_pool_landed() -> bool:
    """Whether this checkout's trainer has the pool's worker id (issue #30's lease per model)."""
    from artery.services.trainer.settings import TrainerSettings

    return "worker_id" in TrainerSettings.__struct_fields__


async def run_phases(stack: Stack, config: Config) -> dict[str, dict]:
    assert stack.nats_url and stack.database_url
    await migrate_when_ready(stack.database_url)
    nc = await nats.connect(stack.nats_url)
    conn = await asyncpg.connect(stack.database_url)
    await init_connection(conn)
    try:
        await bus.provision(nc.jetstream(), CommonSettings(nats_url=stack.nats_url))
        out = {}
        for workers in config.workers:
            print(f"phase: {workers} worker(s)", flush=True)
            out[str(workers)] = await run_phase(stack, nc, conn, config, workers)
        return out
    finally:
        await conn.close()
        await nc.close()


def run(config: Config) -> dict[str, Any]:
    import torch

    postgres_bin_dir()  # fail early, with the package's message, when PostgreSQL is missing
    load_before = load_average()
    with tempfile.TemporaryDirectory(prefix="artery-bench-scale-") as home:
        stack = Stack(home=Path(home), services=(), durable=False)
        try:
            stack.start()
            phases = asyncio.run(run_phases(stack, config))
        except BaseException:
            for process in stack.processes.values():
                print(f"{process.name} log (last lines):\n{harness.tail(process.log_path)}")
            raise
        finally:
            stack.stop()
            if config.logs is not None:  # every service's log, for a phase that stalled
                shutil.copytree(stack.logs, config.logs, dirs_exist_ok=True)
    baseline = phases.get("1")
    speedup = None
    if baseline and baseline["steps_per_s"] and "2" in phases:
        speedup = round(phases["2"]["steps_per_s"] / baseline["steps_per_s"], 2)
    return {
        "benchmark": "scale_out",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": machine(
            load_before, load_average_1m_after=load_average(), torch=torch.__version__, device="cpu"
        ),
        "config": {
            **{k: v for k, v in asdict(config).items() if k not in ("output", "logs")},
            "model": TINY,
            "tenants": list(PROJECTS[: config.projects]),
            "requests_per_phase": config.projects * config.models * config.steps,
            "trainer_pool": trainer_pool_landed(),
        },
        "workers": phases,
        "speedup": speedup,
        "order_violations": sum(p["order_violations"] for p in phases.values()),
        "lost": sum(p["lost"] for p in phases.values()),
        "failed": sum(p["failed"] for p in phases.values()),
        "overlapping_steps": sum(p["overlapping_steps"] for p in phases.values()),
        "starved": any(p["tenants"]["starved"] for p in phases.values()),
    }


def render(result: dict[str, Any]) -> str:
    c, m = result["config"], result["machine"]
    rows: list[tuple[str, ...]] = [
        (
            "workers",
            "steps",
            "s",
            "steps/s",
            "step median s",
            "in steps",
            "violations",
            "overlaps",
            "lost",
            "failed",
            "handoffs",
            "min share",
            "longest wait s",
            "trainer CPU s",
        )
    ]
    for workers, p in result["workers"].items():
        rows.append(
            (
                workers,
                f"{p['steps']}/{p['requests']}",
                f"{p['elapsed_s']:.1f}",
                f"{p['steps_per_s']:.3f}",
                f"{p['step_total_s_median']}",
                f"{p['steps_running_mean']:.2f}",
                str(p["order_violations"]),
                str(p["overlapping_steps"]),
                str(p["lost"]),
                str(p["failed"]),
                str(p["handoffs"]),
                f"{p['tenants']['min_share_while_contended']:.2f}",
                f"{max(t['longest_wait_s'] or 0.0 for t in p['tenants']['projects'].values()):.1f}",
                f"{p['cpu_s'].get('trainer', 0.0):.1f}",
            )
        )
    lines = [
        f"trainer scale-out: {len(c['tenants'])} tenants x {c['models']} models x {c['steps']} steps"
        f" ({c['requests_per_phase']} requests per phase), groups of {c['group_size']} answers of"
        f" ~{c['words']} words on {c['model']},"
        f" {c['threads']} torch thread(s) per worker; trainer pool in this checkout: {c['trainer_pool']}"
        + ("  [--quick]" if c["quick"] else ""),
        f"machine: {m['cpu_count']} CPUs, load {m['load_average_1m_before']} before,"
        f" {m['load_average_1m_after']} after",
        "",
        *table(rows, right=set(range(1, 14))),
        "",
    ]
    for workers, p in result["workers"].items():
        shares = ", ".join(
            f"{name} {t['share_while_contended']:.2f} (first {t['first_step_s']}s, longest wait"
            f" {t['longest_wait_s']}s, others' steps in a row {t['others_steps_in_a_row']},"
            f" per window {t['steps_per_window']})"
            for name, t in p["tenants"]["projects"].items()
        )
        lines.append(f"{workers} worker(s): shares while contended: {shares}; by worker {p['by_worker']}")
        lines += [f"  ! {problem}" for problem in p["order_problems"][:5]]
        lines += [f"  ! failed: {error}" for error in p["failed_errors"]]
    lines.append("")
    lines.append(
        f"speedup 2 over 1: {result['speedup']}x; order violations {result['order_violations']},"
        f" lost {result['lost']}, starved: {result['starved']}"
    )
    return "\n".join(lines)


def parse_args(argv: list[str]) -> Config:
    parser = harness.parser("scale_out", __doc__)
    parser.add_argument("--projects", type=int, default=2, help=f"tenants, 1..{len(PROJECTS)} (default 2)")
    parser.add_argument("--models", type=int, default=2, help="models per tenant (default 2)")
    parser.add_argument(
        "--steps", type=int, help=f"train requests per model (default {DEFAULT_STEPS}; quick {QUICK_STEPS})"
    )
    parser.add_argument("--group-size", type=int, default=32, help="rollouts per group (default 32)")
    parser.add_argument("--words", type=int, default=48, help="words of each rollout's answer (default 48)")
    parser.add_argument(
        "--workers", default="1,2", help="trainer worker counts, one phase each, in order (default 1,2)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker (default 1)")
    parser.add_argument("--windows", type=int, default=4, help="parts of a phase, for shares (default 4)")
    parser.add_argument(
        "--stall-s", type=float, default=90.0, help="no answer for this long ends a phase (default 90)"
    )
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_STEPS} steps per model")
    parser.add_argument("--logs", type=Path, help="copy the services' logs into this directory")
    args = parser.parse_args(argv)
    steps = args.steps or (QUICK_STEPS if args.quick else DEFAULT_STEPS)
    try:
        workers = tuple(int(w) for w in args.workers.split(","))
    except ValueError:
        parser.error("--workers: comma-separated counts, e.g. 1,2")
    if not 1 <= args.projects <= len(PROJECTS):
        parser.error(f"--projects must be 1..{len(PROJECTS)}")
    if min(args.models, steps, args.threads, args.windows, args.words, *workers) < 1 or args.group_size < 2:
        parser.error("counts must be positive, --group-size at least 2")
    return Config(
        projects=args.projects,
        models=args.models,
        steps=steps,
        group_size=args.group_size,
        words=args.words,
        workers=workers,
        threads=args.threads,
        windows=args.windows,
        stall_s=args.stall_s,
        quick=args.quick,
        logs=args.logs,
        output=args.output,
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    config = parse_args(argv_of(argv))
    return report(run(config), render, config.output)


if __name__ == "__main__":
    main()
