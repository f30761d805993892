"""Soak: steady ingest at ~80 % of the measured maximum for minutes; throughput, latency, memory.

What runs: the same private stack as the ingest benchmark (nats-server, durable PostgreSQL and the
real collector process, started by ``artery.ops.stack.Stack``) and, in this process, a publisher of
trajectory groups of the ingest benchmark's shape (``loadtests.ingest``: ~2.1 KB trajectories of
10 messages, ``--group-size`` a group).

1. Probe: after a warm-up, ``--probe-groups`` groups published as fast as the broker acks them;
   the maximum rate is groups divided by the time until the last ``group.ready`` (end to end:
   rows committed and announced), as the ingest benchmark measures it.
2. Steady: groups published at ``--load`` (default 0.8) of that rate, paced evenly, for
   ``--duration`` seconds (default 300). Every ``--interval`` seconds a sample: groups published
   and stored (``group.ready`` received) per second, the publish-to-``group.ready`` latency p50
   and p99 of the groups stored in that window, the backlog (published, not yet stored), and the
   collector process's resident memory (RSS) and CPU share.
3. Drain: the backlog left at the end is waited for, then the rows in PostgreSQL are counted.

Memory is flat when, over the second half of the run (after start-up and the caches have
filled), the least-squares trend of the collector's RSS grows it by less than
``MEMORY_GROWTH_LIMIT`` of its mean, and its max/min ratio stays below ``MEMORY_RATIO_LIMIT``.

Each group is encoded once as a template (a few templates in turn); a published copy gets a new
event id and the current time, so every group is distinct and ``submitted_at`` is real (the
database's ``stored_at - submitted_at`` is reported beside the client-side latency).

Long module: one scenario, read top to bottom: the paced load, the sampling, the memory verdict, the
result and its table. What every benchmark shares is ``loadtests/harness.py``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime as dt
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import msgspec
import nats

from artery.ops.stack import Stack
from artery.schemas import new_event_id, utcnow
from artery.shared import subjects
from artery.shared.bus import MSG_ID, event_headers
from artery.shared.codec import encode
from loadtests import harness
from loadtests.harness import (
    argv_of,
    collector_stack,
    load_average,
    machine,
    percentile,
    proc_cpu_s,
    report,
    table,
)
from loadtests.ingest import (
    PROJECT,
    Payload,
    _ReadyId,
    build_group,
    count_rows,
    publish_end_to_end,
    wait_for_collector,
)

MODEL = "soak"
PROBE_MODEL = "soak-probe"
WARMUP_MODEL = "soak-warmup"
DEFAULT_DURATION_S = 300.0
DEFAULT_INTERVAL_S = 5.0
DEFAULT_LOAD = 0.8
DEFAULT_PROBE_GROUPS = 4000
DEFAULT_WARMUP_GROUPS = 300
TEMPLATES = 16
#: Flat memory: over the second half, trend growth below 5 % of the mean and max/min below 1.10.
MEMORY_GROWTH_LIMIT = 0.05
MEMORY_RATIO_LIMIT = 1.10


@dataclass
class Config:
    duration_s: float
    interval_s: float
    load: float
    probe_groups: int
    warmup_groups: int
    group_size: int
    max_in_flight: int
    drain_timeout_s: float
    durable: bool
    seed: int
    output: Path


class PayloadFactory:
    """Distinct groups from a few encoded templates: a new event id and time for each copy."""

    def __init__(self, model: str, size: int, seed: int, templates: int = TEMPLATES):
        self._templates = []
        for i in range(templates):
            group = build_group(model, size, seed + i)
            data, old_id, old_time = encode(group), group.id.encode(), msgspec.json.encode(group.time)
            if data.count(old_id) != 1 or data.count(old_time) != 1:
                raise RuntimeError("a template's id or time is not unique in its encoding")
            self._templates.append((data, old_id, old_time, event_headers(group)))
        self._next = 0
        self.bytes = [len(t[0]) for t in self._templates]

    def make(self) -> Payload:
        data, old_id, old_time, headers = self._templates[self._next % len(self._templates)]
        self._next += 1
        group_id = new_event_id()
        data = data.replace(old_id, group_id.encode()).replace(old_time, msgspec.json.encode(utcnow()))
        return Payload(group_id, data, {**headers, MSG_ID: group_id})

    def batch(self, n: int) -> list[Payload]:
        return [self.make() for _ in range(n)]


def rss_bytes(pid: int) -> int:
    """Resident memory of one process: psutil where installed, else Linux ``/proc``; 0 if gone."""
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        try:
            return psutil.Process(pid).memory_info().rss
        except psutil.Error:
            return 0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def trend(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of y over x (0 with fewer than two distinct x)."""
    if len(points) < 2:
        return 0.0
    mx = statistics.fmean(x for x, _ in points)
    my = statistics.fmean(y for _, y in points)
    var = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / var if var else 0.0


def memory_verdict(samples: list[dict], duration_s: float) -> dict:
    rss = [(s["t_s"], s["collector_rss_mb"]) for s in samples if s["collector_rss_mb"] > 0]
    half = [(t, m) for t, m in rss if t >= duration_s / 2] or rss
    if not half:
        return {"flat": False, "reason": "no memory samples"}
    values = [m for _, m in half]
    slope = trend(half)  # MB per second
    span = (half[-1][0] - half[0][0]) if len(half) > 1 else 0.0
    growth = slope * span
    mean = statistics.fmean(values)
    ratio = max(values) / min(values)
    relative = growth / mean if mean else 0.0
    return {
        "start_mb": rss[0][1],
        "end_mb": rss[-1][1],
        "min_mb": min(m for _, m in rss),
        "max_mb": max(m for _, m in rss),
        "second_half": {
            "samples": len(half),
            "mean_mb": round(mean, 1),
            "slope_mb_per_min": round(slope * 60, 3),
            "trend_growth_mb": round(growth, 2),
            "trend_growth_share": round(relative, 4),
            "max_min_ratio": round(ratio, 4),
        },
        "limits": {"trend_growth_share": MEMORY_GROWTH_LIMIT, "max_min_ratio": MEMORY_RATIO_LIMIT},
        "flat": relative < MEMORY_GROWTH_LIMIT and ratio < MEMORY_RATIO_LIMIT,
    }


class Steady:
    """Publishes at a fixed rate and follows each group to its ``group.ready``."""

    def __init__(self, nc: nats.NATS, factory: PayloadFactory, rate: float, config: Config):
        self.nc = nc
        self.js = nc.jetstream(publish_async_max_pending=config.max_in_flight)
        self.factory = factory
        self.rate = rate
        self.config = config
        self.published = 0
        self.ready = 0
        self.ready_in_run = 0
        self.publish_errors = 0
        self.duplicates = 0
        self.published_at: dict[str, float] = {}
        self.window: list[float] = []  # latencies (ms) of groups stored since the last sample
        self.latencies: list[float] = []  # every latency (ms) while the rate was held
        self.finished = False
        self.finished_at = 0.0
        self.drained_at = 0.0
        self._decoder = msgspec.json.Decoder(_ReadyId)
        self._acks: collections.deque = collections.deque()
        self.drained = asyncio.Event()  # set once everything published is stored, after the run

    def _check_drained(self) -> None:
        if self.finished and self.ready >= self.published and not self.drained.is_set():
            self.drained_at = time.perf_counter()
            self.drained.set()

    async def on_ready(self, msg) -> None:
        now = time.perf_counter()
        sent = self.published_at.pop(self._decoder.decode(msg.data).group_id, None)
        if sent is None:
            return  # a repeat, or another model's
        self.ready += 1
        latency = (now - sent) * 1000
        self.window.append(latency)
        if not self.finished:
            self.ready_in_run += 1
            self.latencies.append(latency)
        self._check_drained()

    def _settle_acks(self) -> None:
        while self._acks and self._acks[0].done():
            future = self._acks.popleft()
            if future.exception() is not None:
                self.publish_errors += 1
            elif future.result().duplicate:
                self.duplicates += 1

    async def publish(self, started: float) -> None:
        subject = subjects.trajectories(PROJECT, MODEL)
        while True:
            elapsed = time.perf_counter() - started
            if elapsed >= self.config.duration_s:
                break
            due = min(int(elapsed * self.rate) + 1, int(self.config.duration_s * self.rate))
            while self.published < due:
                p = self.factory.make()
                # Waits here when max_in_flight publishes are unacked: the broker sets the pace.
                self._acks.append(await self.js.publish_async(subject, p.data, headers=p.headers))
                self.published_at[p.group_id] = time.perf_counter()
                self.published += 1
                if self.published % 32 == 0:
                    await asyncio.sleep(0)  # let group.ready callbacks run
            self._settle_acks()
            await asyncio.sleep(min(0.005, 1 / self.rate))
        self.finished, self.finished_at = True, time.perf_counter()
        self._check_drained()
        if self._acks:
            await asyncio.gather(*self._acks, return_exceptions=True)
        self._settle_acks()

    async def sample(self, started: float, collector_pid: int, samples: list[dict]) -> None:
        last_t, last_pub, last_ready, last_cpu = 0.0, 0, 0, proc_cpu_s(collector_pid)
        size = self.config.group_size
        k = 1
        while k * self.config.interval_s <= self.config.duration_s + 1e-6:  # one sample a window
            await asyncio.sleep(max(0.0, started + k * self.config.interval_s - time.perf_counter()))
            k += 1
            t = time.perf_counter() - started
            window, self.window = self.window, []
            cpu = proc_cpu_s(collector_pid)
            dt_s = max(t - last_t, 1e-9)
            row = {
                "t_s": round(t, 2),
                "published_per_s": round((self.published - last_pub) / dt_s, 1),
                "stored_per_s": round((self.ready - last_ready) / dt_s, 1),
                "trajectories_stored_per_s": round((self.ready - last_ready) * size / dt_s, 1),
                "latency_p50_ms": round(percentile(window, 50), 2) if window else None,
                "latency_p99_ms": round(percentile(window, 99), 2) if window else None,
                "backlog_groups": self.published - self.ready,
                "collector_rss_mb": round(rss_bytes(collector_pid) / 2**20, 1),
                "collector_cpu": round((cpu - last_cpu) / dt_s, 3),
            }
            samples.append(row)
            print(
                f"  t={row['t_s']:6.1f}s  published {row['published_per_s']:8,.1f}/s  "
                f"stored {row['stored_per_s']:8,.1f}/s  p50 {row['latency_p50_ms']} ms  "
                f"p99 {row['latency_p99_ms']} ms  backlog {row['backlog_groups']}  "
                f"collector {row['collector_rss_mb']} MB, cpu {row['collector_cpu']:.0%}",
                flush=True,
            )
            last_t, last_pub, last_ready, last_cpu = t, self.published, self.ready, cpu


async def db_latency(database_url: str) -> dict:
    """``stored_at - submitted_at`` of the steady groups (submit to the storing transaction's start)."""
    conn = await asyncpg.connect(database_url)
    try:
        row = await conn.fetchrow(
            "SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY d) AS p50,"
            " percentile_cont(0.99) WITHIN GROUP (ORDER BY d) AS p99, max(d) AS max FROM"
            " (SELECT extract(epoch FROM stored_at - submitted_at) * 1000 AS d FROM trajectory_groups"
            "  WHERE project = $1 AND model = $2) s",
            PROJECT,
            MODEL,
        )
        return {k: round(float(row[k]), 2) if row[k] is not None else None for k in ("p50", "p99", "max")}
    finally:
        await conn.close()


async def run(config: Config, stack: Stack) -> dict:
    load_before = load_average()
    nc = await nats.connect(stack.nats_url, name="bench-soak")
    try:
        await wait_for_collector(nc, stack)
        collector_pid = stack.processes["collector"].proc.pid
        warmup = PayloadFactory(WARMUP_MODEL, config.group_size, config.seed).batch(config.warmup_groups)
        if warmup:
            w = await publish_end_to_end(nc, warmup, config.max_in_flight, WARMUP_MODEL, 120.0)
            if w.missing:
                raise RuntimeError(f"warm-up: {w.missing} group.ready events missing")

        # 1. The maximum: a burst, timed until the last group.ready.
        probe_payloads = PayloadFactory(PROBE_MODEL, config.group_size, config.seed).batch(
            config.probe_groups
        )
        probe = await publish_end_to_end(nc, probe_payloads, config.max_in_flight, PROBE_MODEL, 300.0)
        if probe.missing:
            raise RuntimeError(f"probe: {probe.missing} group.ready events missing")
        max_rate = config.probe_groups / probe.elapsed_s
        target = config.load * max_rate
        print(
            f"probe: {config.probe_groups} groups in {probe.elapsed_s:.2f}s = {max_rate:,.0f} groups/s "
            f"({max_rate * config.group_size:,.0f} trajectories/s); holding {target:,.0f} groups/s "
            f"for {config.duration_s:.0f}s",
            flush=True,
        )

        # 2. Steady load, sampled.
        factory = PayloadFactory(MODEL, config.group_size, config.seed)
        steady = Steady(nc, factory, target, config)
        sub = await nc.subscribe(subjects.group_ready(PROJECT, MODEL), cb=steady.on_ready)
        await nc.flush()
        samples: list[dict] = []
        rss_before = round(rss_bytes(collector_pid) / 2**20, 1)
        started = time.perf_counter()
        sampler = asyncio.create_task(steady.sample(started, collector_pid, samples))
        await steady.publish(started)
        held_s = steady.finished_at - started
        ready_in_run = steady.ready_in_run
        await sampler

        # 3. Drain what is left, then count the rows.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(steady.drained.wait(), config.drain_timeout_s)
        # From the end of the steady load until the last group was stored (None: never).
        drain_s = steady.drained_at - steady.finished_at if steady.drained.is_set() else None
        await sub.unsubscribe()
        groups_stored, rows = await count_rows(stack.database_url, MODEL)
        from_db = await db_latency(stack.database_url)
    finally:
        await nc.close()

    lat = steady.latencies
    size = config.group_size
    memory = memory_verdict(samples, config.duration_s)
    memory["before_load_mb"] = rss_before
    return {
        "benchmark": "soak",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": machine(load_before),
        "config": {
            "duration_s": config.duration_s,
            "interval_s": config.interval_s,
            "load": config.load,
            "probe_groups": config.probe_groups,
            "warmup_groups": config.warmup_groups,
            "group_size": size,
            "group_bytes_mean": round(statistics.fmean(factory.bytes)),
            "max_in_flight": config.max_in_flight,
            "postgres_durable": config.durable,
        },
        "probe": {
            "groups": config.probe_groups,
            "seconds": round(probe.elapsed_s, 3),
            "groups_per_s": round(max_rate, 1),
            "trajectories_per_s": round(max_rate * size, 1),
            "latency_ms": {"p50": round(percentile(probe.latencies_ms, 50), 2)},
        },
        "steady": {
            "target_groups_per_s": round(target, 1),
            "target_trajectories_per_s": round(target * size, 1),
            "seconds": round(held_s, 2),
            "published_groups": steady.published,
            "published_per_s": round(steady.published / held_s, 1),
            "stored_per_s": round(ready_in_run / held_s, 1),
            "trajectories_stored_per_s": round(ready_in_run * size / held_s, 1),
            "held_share_of_target": round(ready_in_run / held_s / target, 3) if target else 0.0,
            "latency_ms": {
                "p50": round(percentile(lat, 50), 2) if lat else None,
                "p99": round(percentile(lat, 99), 2) if lat else None,
                "max": round(max(lat), 2) if lat else None,
            },
            "db_latency_ms": from_db,
            "backlog_at_end": steady.published - ready_in_run,
            "drain_s": round(drain_s, 3) if drain_s is not None else None,
            "publish_errors": steady.publish_errors,
            "duplicates": steady.duplicates,
            "groups_stored": groups_stored,
            "rows_verified": rows,
            "rows_ok": groups_stored == steady.published and rows == steady.published * size,
        },
        "memory": memory,
        "samples": samples,
    }


def render(result: dict) -> str:
    c, p, s, m = result["config"], result["probe"], result["steady"], result["memory"]
    lat, db, machine = s["latency_ms"], s["db_latency_ms"], result["machine"]
    summary = [
        ("", "groups/s", "trajectories/s", "note"),
        ("maximum (probe burst)", f"{p['groups_per_s']:,.0f}", f"{p['trajectories_per_s']:,.0f}",
         f"{p['groups']:,} groups in {p['seconds']:.2f} s, end to end"),
        ("target", f"{s['target_groups_per_s']:,.0f}", f"{s['target_trajectories_per_s']:,.0f}",
         f"{c['load']:.0%} of the maximum"),
        ("published", f"{s['published_per_s']:,.0f}", "",
         f"{s['published_groups']:,} groups in {s['seconds']:.0f} s"),
        ("stored (held)", f"{s['stored_per_s']:,.0f}", f"{s['trajectories_stored_per_s']:,.0f}",
         f"{s['held_share_of_target']:.0%} of the target; backlog at the end {s['backlog_at_end']:,}, "
         f"drained in {s['drain_s']} s"),
        ("publish -> group.ready", "", f"p50 {lat['p50']} ms", f"p99 {lat['p99']} ms, max {lat['max']} ms"),
        ("submitted -> stored_at (db)", "", f"p50 {db['p50']} ms", f"p99 {db['p99']} ms, max {db['max']} ms"),
        ("rows verified", f"{s['groups_stored']:,}", f"{s['rows_verified']:,}",
         "OK" if s["rows_ok"] else "<< MISMATCH"),
    ]  # fmt: skip
    rows = [("t s", "pub/s", "stored/s", "traj/s", "p50 ms", "p99 ms", "backlog", "RSS MB", "cpu")]
    for x in result["samples"]:
        rows.append(
            (
                f"{x['t_s']:.1f}",
                f"{x['published_per_s']:,.0f}",
                f"{x['stored_per_s']:,.0f}",
                f"{x['trajectories_stored_per_s']:,.0f}",
                "-" if x["latency_p50_ms"] is None else f"{x['latency_p50_ms']:,.1f}",
                "-" if x["latency_p99_ms"] is None else f"{x['latency_p99_ms']:,.1f}",
                f"{x['backlog_groups']:,}",
                f"{x['collector_rss_mb']:.1f}",
                f"{x['collector_cpu']:.0%}",
            )
        )
    half = m.get("second_half", {})
    memory_line = (
        f"collector memory: {m.get('before_load_mb')} MB before the load, {m.get('start_mb')} MB at the "
        f"first sample, {m.get('end_mb')} MB at the end (min {m.get('min_mb')}, max {m.get('max_mb')}); "
        f"second half: trend {half.get('slope_mb_per_min')} MB/min "
        f"({half.get('trend_growth_share', 0):.1%} of {half.get('mean_mb')} MB), "
        f"max/min {half.get('max_min_ratio')}: " + ("FLAT" if m["flat"] else "NOT FLAT")
    )
    return "\n".join(
        [
            f"soak: {c['duration_s']:.0f} s at {c['load']:.0%} of the maximum, groups of {c['group_size']} "
            f"(~{c['group_bytes_mean']:,} B), sampled every {c['interval_s']:.0f} s, "
            f"PostgreSQL durable={c['postgres_durable']}",
            f"machine: {machine['cpu_count']} CPUs (load {machine['load_average_1m_before']} before)",
            "",
            *table(summary, right={1, 2}),
            "",
            *table(rows, right=set(range(9))),
            "",
            memory_line,
        ]
    )


def parse_args(argv: list[str]) -> Config:
    parser = harness.parser("soak", __doc__, prog="python -m loadtests.soak")
    parser.add_argument("--duration", type=float, default=DEFAULT_DURATION_S, help="seconds of steady load")
    parser.add_argument("--interval", type=float, default=DEFAULT_INTERVAL_S, help="seconds between samples")
    parser.add_argument("--load", type=float, default=DEFAULT_LOAD, help="share of the maximum rate to hold")
    parser.add_argument("--probe-groups", type=int, default=DEFAULT_PROBE_GROUPS, help="groups of the probe")
    parser.add_argument("--warmup-groups", type=int, default=DEFAULT_WARMUP_GROUPS)
    parser.add_argument("--group-size", type=int, default=8, help="trajectories a group")
    parser.add_argument("--max-in-flight", type=int, default=256, help="unacked publishes")
    parser.add_argument("--drain-timeout", type=float, default=300.0, help="longest wait for the backlog")
    parser.add_argument(
        "--no-durable", dest="durable", action="store_false", help="PostgreSQL with fsync off"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.duration <= 0 or args.interval <= 0 or not 0 < args.load <= 1:
        parser.error("--duration and --interval must be positive, --load in (0, 1]")
    if min(args.probe_groups, args.group_size, args.max_in_flight) < 1 or args.warmup_groups < 0:
        parser.error("--probe-groups, --group-size and --max-in-flight must be positive")
    return Config(
        duration_s=args.duration,
        interval_s=args.interval,
        load=args.load,
        probe_groups=args.probe_groups,
        warmup_groups=args.warmup_groups,
        group_size=args.group_size,
        max_in_flight=args.max_in_flight,
        drain_timeout_s=args.drain_timeout,
        durable=args.durable,
        seed=args.seed,
        output=args.output,
    )


def main(argv: list[str] | None = None) -> dict:
    config = parse_args(argv_of(argv))
    with collector_stack(config.durable, prefix="artery-soak-") as stack:
        result = asyncio.run(run(config, stack))
    return report(result, render, config.output)


if __name__ == "__main__":
    main()
