"""Ingest benchmark: trajectory groups from publish to committed PostgreSQL rows plus ``group.ready``.

What runs: a private nats-server (JetStream, file store) and a private PostgreSQL cluster under a
temporary directory, and the real collector service as a child process
(``python -m artery.services.collector``), all started by ``artery.ops.stack.Stack``.

What is measured, on the same server, with the same encoded payloads:

- raw: the JetStream publish rate into a stream nobody consumes (``BENCH_RAW``, ``bench.raw.>``),
  pipelined (``publish_async``, bounded in-flight), until every ack is in. The ceiling: what the
  broker and this client take on this machine before anything is stored or announced.
- end to end: the same kind of payloads (distinct ids) published to the trajectory subject,
  pipelined the same way; the clock stops when the last ``group.ready`` has arrived (the
  collector announces a group only after its rows are committed). Per group: the time from its
  publish to its ``group.ready``. Afterwards the rows in PostgreSQL are counted.
- light load: a few groups published one at a time, well below capacity: the latency one agent
  sees when nothing is queued.

Everything shares the machine's cores (publisher, nats-server, collector, PostgreSQL), as it would
on a single-machine ``artery up``; the figures say what this machine does, not what each part could
do alone. The CPU seconds each part used are reported beside the rates (Linux ``/proc``), with what
other processes on the machine used meanwhile, since that lowers the figures. Latency is measured
under a saturating burst (everything published as fast as the broker acks it), so it includes the
time a group waits in the stream behind the groups published before it.

Collector settings come from the environment (``ARTERY_COLLECTOR_*``), as for the service itself.

Long module: one benchmark, read top to bottom: its payloads, the three measurements (raw, end to end,
light load), the result and its table. What every benchmark shares is ``loadtests/harness.py``.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import msgspec
import nats
from nats.js.api import RetentionPolicy, StorageType, StreamConfig

from artery.ops.stack import Stack
from artery.schemas import TrajectoryGroupSubmitted
from artery.services.collector.settings import PREFIX as COLLECTOR_PREFIX
from artery.services.collector.settings import CollectorSettings
from artery.shared import subjects
from artery.shared.bus import DUPLICATE_WINDOW_S, event_headers
from artery.shared.codec import encode
from artery.shared.embedded import nats_server_binary
from artery.shared.settings import load
from loadtests import harness
from loadtests.harness import (
    CpuMeter,
    argv_of,
    collector_stack,
    load_average,
    machine,
    percentile,
    report,
    table,
    tail,
    version,
)

PROJECT = "bench"
MODEL = "ingest"
WARMUP_MODEL = "warmup"
LIGHT_MODEL = "light"
RAW_STREAM = "BENCH_RAW"
RAW_SUBJECTS = "bench.raw.>"

#: Goals stated by the issue.
GOAL_TRAJECTORIES_PER_S = 10_000
GOAL_RATIO_TO_RAW = 0.5

DEFAULT_GROUPS = 8000
DEFAULT_GROUP_SIZE = 8
DEFAULT_WARMUP_GROUPS = 300
DEFAULT_MAX_IN_FLIGHT = 256
DEFAULT_RAW_RUNS = 3
DEFAULT_LIGHT_GROUPS = 50
LIGHT_INTERVAL_S = 0.05
QUICK_GROUPS = 20
QUICK_WARMUP_GROUPS = 5
#: Warn when processes outside the benchmark took more than this share of the machine.
OTHER_LOAD_WARNING = 0.1


# --- payloads -------------------------------------------------------------------------------


def build_group(model: str, size: int, seed: int) -> TrajectoryGroupSubmitted:
    return harness.build_group(PROJECT, model, size, seed, metadata={"bench_seed": seed})


@dataclass(frozen=True)
class Payload:
    group_id: str
    data: bytes
    headers: dict[str, str]


def build_payloads(model: str, groups: int, size: int, seed: int) -> list[Payload]:
    """Distinct groups (unique event ids), encoded once, before any clock starts."""
    out = []
    for i in range(groups):
        group = build_group(model, size, seed + i)
        out.append(Payload(group.id, encode(group), event_headers(group)))
    return out


# --- measurements ---------------------------------------------------------------------------


RAW_STREAM_CONFIG = StreamConfig(
    name=RAW_STREAM,
    subjects=[RAW_SUBJECTS],
    retention=RetentionPolicy.LIMITS,
    storage=StorageType.FILE,  # as the TRAJECTORIES stream (see shared.bus.stream_config)
    duplicate_window=DUPLICATE_WINDOW_S,
    max_msg_size=8 * 1024 * 1024,
)


async def publish_raw(nc: nats.NATS, payloads: list[Payload], max_in_flight: int) -> float:
    """Seconds to publish ``payloads`` into a fresh unconsumed stream and collect every ack.

    The stream is deleted afterwards, so that a repeat with the same payloads (same
    ``Nats-Msg-Id``) is stored again rather than de-duplicated.
    """
    js = nc.jetstream(publish_async_max_pending=max_in_flight)
    await js.add_stream(RAW_STREAM_CONFIG)
    subject = f"bench.raw.{PROJECT}.{MODEL}"
    try:
        start = time.perf_counter()
        futures = [await js.publish_async(subject, p.data, headers=p.headers) for p in payloads]
        acks = await asyncio.gather(*futures)
        elapsed = time.perf_counter() - start
    finally:
        await js.delete_stream(RAW_STREAM)
    if any(a.duplicate for a in acks):
        raise RuntimeError("raw publish: the server reported duplicates; payload ids are not distinct")
    return elapsed


@dataclass
class EndToEnd:
    elapsed_s: float
    publish_s: float  # until every publish ack was in
    latencies_ms: list[float]
    missing: int


async def publish_end_to_end(
    nc: nats.NATS,
    payloads: list[Payload],
    max_in_flight: int,
    model: str,
    timeout_s: float,
    interval_s: float = 0.0,
) -> EndToEnd:
    """Publish every payload (pipelined, or one every ``interval_s``) and wait for each group.ready."""
    if not payloads:
        return EndToEnd(0.0, 0.0, [], 0)
    js = nc.jetstream(publish_async_max_pending=max_in_flight)
    subject = subjects.trajectories(PROJECT, model)
    expected = {p.group_id for p in payloads}
    published_at: dict[str, float] = {}
    ready_at: dict[str, float] = {}
    all_ready = asyncio.Event()
    decoder = msgspec.json.Decoder(_ReadyId)

    async def on_ready(msg) -> None:
        now = time.perf_counter()
        group_id = decoder.decode(msg.data).group_id
        if group_id in expected and group_id not in ready_at:
            ready_at[group_id] = now
            if len(ready_at) == len(expected):
                all_ready.set()

    sub = await nc.subscribe(subjects.group_ready(PROJECT, model), cb=on_ready)
    await nc.flush()
    try:
        start = time.perf_counter()
        futures = []
        for p in payloads:
            # After publish_async returns, the message is in the client's write buffer (it may
            # have waited for an in-flight slot first).
            futures.append(await js.publish_async(subject, p.data, headers=p.headers))
            published_at[p.group_id] = time.perf_counter()
            if interval_s:
                await asyncio.sleep(interval_s)
        acks = await asyncio.gather(*futures)
        publish_s = time.perf_counter() - start
        if any(a.duplicate for a in acks):
            raise RuntimeError("the server reported duplicates; payload ids are not distinct")
        try:
            await asyncio.wait_for(all_ready.wait(), timeout_s)
        except TimeoutError:
            pass
        end = max(ready_at.values(), default=time.perf_counter())
    finally:
        await sub.unsubscribe()
    latencies = [(ready_at[g] - published_at[g]) * 1000 for g in ready_at]
    return EndToEnd(end - start, publish_s, latencies, len(expected) - len(ready_at))


class _ReadyId(msgspec.Struct):
    """The one field of ``GroupReady`` the benchmark needs (other fields are ignored)."""

    group_id: str


async def count_rows(database_url: str, model: str) -> tuple[int, int]:
    conn = await asyncpg.connect(database_url)
    try:
        groups = await conn.fetchval(
            "SELECT count(*) FROM trajectory_groups WHERE project = $1 AND model = $2", PROJECT, model
        )
        rows = await conn.fetchval(
            "SELECT count(*) FROM trajectories t JOIN trajectory_groups g ON g.id = t.group_id"
            " WHERE g.project = $1 AND g.model = $2",
            PROJECT,
            model,
        )
        return groups, rows
    finally:
        await conn.close()


async def postgres_settings(database_url: str) -> dict[str, str]:
    conn = await asyncpg.connect(database_url)
    try:
        out = {"version": await conn.fetchval("SHOW server_version")}
        for name in ("fsync", "synchronous_commit", "full_page_writes"):
            out[name] = await conn.fetchval(f"SHOW {name}")
        return out
    finally:
        await conn.close()


async def wait_for_collector(nc: nats.NATS, stack: Stack, timeout_s: float = 60.0) -> None:
    """The collector has provisioned the streams, migrated and created its durable consumer."""
    js = nc.jetstream()
    deadline = time.monotonic() + timeout_s
    while True:
        for process in stack.processes.values():
            if not process.running:
                raise RuntimeError(f"the collector exited; see {process.log_path}\n{tail(process.log_path)}")
        try:
            await js.consumer_info(subjects.TRAJECTORIES.name, subjects.COLLECTOR_CONSUMER)
            return
        except Exception:
            if time.monotonic() > deadline:
                raise TimeoutError(f"collector not consuming after {timeout_s}s") from None
            await asyncio.sleep(0.05)


# --- the run --------------------------------------------------------------------------------


@dataclass
class Config:
    groups: int
    group_size: int
    warmup_groups: int
    max_in_flight: int
    raw_runs: int
    light_groups: int
    collectors: int
    quick: bool
    timeout_s: float
    durable: bool
    seed: int
    output: Path


async def run(config: Config, stack: Stack) -> dict:
    load_before = load_average()
    nc = await nats.connect(stack.nats_url, name="bench-ingest")
    try:
        await wait_for_collector(nc, stack)
        seed = config.seed
        warmup = build_payloads(WARMUP_MODEL, config.warmup_groups, config.group_size, seed)
        seed += config.warmup_groups
        t = time.perf_counter()
        measured = build_payloads(MODEL, config.groups, config.group_size, seed)
        build_s = time.perf_counter() - t
        seed += config.groups
        light_payloads = build_payloads(LIGHT_MODEL, config.light_groups, config.group_size, seed)
        payload_bytes = [len(p.data) for p in measured]

        # Warm-up: connections, pools, the models row, the collector's first batches.
        if warmup:
            await publish_raw(nc, warmup, config.max_in_flight)
            w = await publish_end_to_end(nc, warmup, config.max_in_flight, WARMUP_MODEL, config.timeout_s)
            if w.missing:
                raise RuntimeError(
                    f"warm-up: {w.missing} group.ready events missing after {config.timeout_s}s"
                )

        meter = CpuMeter(stack)
        c0 = meter.snapshot()
        raw_runs = [await publish_raw(nc, measured, config.max_in_flight) for _ in range(config.raw_runs)]
        raw_s = statistics.median(raw_runs)
        c1 = meter.snapshot()
        e2e = await publish_end_to_end(nc, measured, config.max_in_flight, MODEL, config.timeout_s)
        c2 = meter.snapshot()
        raw_cpu = {k: round(v / config.raw_runs, 2) for k, v in meter.delta(c0, c1).items()}
        e2e_cpu = meter.delta(c1, c2)
        # Light load: one group at a time, well below capacity, so latency is not queueing.
        light = await publish_end_to_end(
            nc, light_payloads, config.max_in_flight, LIGHT_MODEL, config.timeout_s, LIGHT_INTERVAL_S
        )
        groups_stored, rows = await count_rows(stack.database_url, MODEL)
        pg = await postgres_settings(stack.database_url)
    finally:
        await nc.close()

    trajectories = config.groups * config.group_size
    raw_tps = trajectories / raw_s
    e2e_tps = trajectories / e2e.elapsed_s if not e2e.missing else 0.0
    ratio = e2e_tps / raw_tps
    result = {
        "benchmark": "ingest",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": machine(
            load_before,
            nats_server=version([nats_server_binary(), "--version"]),
            postgres=pg["version"],
        ),
        "durability": {
            "postgres_durable": config.durable,
            "postgres_fsync": pg["fsync"],
            "postgres_synchronous_commit": pg["synchronous_commit"],
            "jetstream_storage": "file",
        },
        "config": {
            "groups": config.groups,
            "group_size": config.group_size,
            "trajectories": trajectories,
            "warmup_groups": config.warmup_groups,
            "max_in_flight": config.max_in_flight,
            "collector_processes": config.collectors,
            "quick": config.quick,
            "collector_settings": msgspec.structs.asdict(
                load(CollectorSettings, COLLECTOR_PREFIX, stack.service_env())
            ),
        },
        "payload": {
            "group_bytes_mean": round(statistics.fmean(payload_bytes)),
            "trajectory_bytes_mean": round(statistics.fmean(payload_bytes) / config.group_size),
            "messages_per_trajectory": 10,
            "build_s": round(build_s, 3),
        },
        "raw_publish": {
            "runs": config.raw_runs,
            "runs_trajectories_per_s": [round(trajectories / r, 1) for r in raw_runs],
            "seconds": round(raw_s, 4),  # the median run
            "groups_per_s": round(config.groups / raw_s, 1),
            "trajectories_per_s": round(raw_tps, 1),
            "mb_per_s": round(sum(payload_bytes) / raw_s / 1e6, 2),
            "cpu_s": raw_cpu,
        },
        "end_to_end": {
            "seconds": round(e2e.elapsed_s, 4),
            "publish_acked_s": round(e2e.publish_s, 4),
            "groups_per_s": round(config.groups / e2e.elapsed_s, 1) if not e2e.missing else 0.0,
            "trajectories_per_s": round(e2e_tps, 1),
            "ratio_to_raw": round(ratio, 3),
            "latency_ms": {
                "p50": round(percentile(e2e.latencies_ms, 50), 2) if e2e.latencies_ms else None,
                "p99": round(percentile(e2e.latencies_ms, 99), 2) if e2e.latencies_ms else None,
                "max": round(max(e2e.latencies_ms), 2) if e2e.latencies_ms else None,
            },
            "light_load_latency_ms": {
                "groups": config.light_groups,
                "interval_ms": LIGHT_INTERVAL_S * 1000,
                "p50": round(percentile(light.latencies_ms, 50), 2) if light.latencies_ms else None,
                "p99": round(percentile(light.latencies_ms, 99), 2) if light.latencies_ms else None,
                "missing": light.missing,
            },
            "ready_events": config.groups - e2e.missing,
            "ready_missing": e2e.missing,
            "groups_stored": groups_stored,
            "rows_expected": trajectories,
            "rows_verified": rows,
            "rows_ok": rows == trajectories and groups_stored == config.groups,
            "cpu_s": e2e_cpu,
        },
        "goals": {
            "trajectories_per_s": {
                "goal": GOAL_TRAJECTORIES_PER_S,
                "reached": round(e2e_tps, 1),
                "status": "PASS" if e2e_tps >= GOAL_TRAJECTORIES_PER_S else "BELOW",
            },
            "ratio_to_raw": {
                "goal": GOAL_RATIO_TO_RAW,
                "reached": round(ratio, 3),
                "status": "PASS" if ratio >= GOAL_RATIO_TO_RAW else "BELOW",
            },
        },
    }
    return result


def render(result: dict) -> str:
    m, d, c, p = result["machine"], result["durability"], result["config"], result["payload"]
    raw, e2e, goals = result["raw_publish"], result["end_to_end"], result["goals"]
    lat = e2e["latency_ms"]
    runs = ", ".join(f"{r:,.0f}" for r in raw["runs_trajectories_per_s"])
    figures = [
        ("", "groups/s", "trajectories/s", "note"),
        (
            "raw JetStream publish",
            f"{raw['groups_per_s']:,.0f}",
            f"{raw['trajectories_per_s']:,.0f}",
            f"{raw['mb_per_s']} MB/s; median of {raw['runs']} run(s): {runs} trajectories/s",
        ),
        (
            "end to end (rows + ready)",
            f"{e2e['groups_per_s']:,.0f}",
            f"{e2e['trajectories_per_s']:,.0f}",
            f"{e2e['seconds']:.2f}s; every publish acked after {e2e['publish_acked_s']:.2f}s",
        ),
        ("end to end / raw", "", f"{e2e['ratio_to_raw']:.2f}", ""),
        (
            "publish-to-ready p50",
            "",
            f"{lat['p50']:,.1f} ms",
            "burst: includes queueing behind earlier groups",
        ),
        ("publish-to-ready p99", "", f"{lat['p99']:,.1f} ms", f"max {lat['max']:,.1f} ms"),
    ]
    light = e2e.get("light_load_latency_ms") or {}
    if light.get("p50") is not None:
        figures += [
            (
                "light load p50 / p99",
                "",
                f"{light['p50']:,.1f} / {light['p99']:,.1f} ms",
                f"{light['groups']} groups, one every {light['interval_ms']:.0f} ms",
            )
        ]
    figures += [
        (
            "rows verified",
            f"{e2e['groups_stored']:,}",
            f"{e2e['rows_verified']:,}",
            f"expected {e2e['rows_expected']:,} trajectories, {c['groups']:,} groups; "
            f"{e2e['ready_events']:,} group.ready" + ("" if e2e["rows_ok"] else "  << MISMATCH"),
        ),
    ]
    goal_rows = [
        ("goal", "target", "reached", "status"),
        (
            "end to end trajectories/s",
            f">= {GOAL_TRAJECTORIES_PER_S:,}",
            f"{goals['trajectories_per_s']['reached']:,.0f}",
            goals["trajectories_per_s"]["status"],
        ),
        (
            "end to end / raw publish",
            f">= {GOAL_RATIO_TO_RAW:.2f}",
            f"{goals['ratio_to_raw']['reached']:.2f}",
            goals["ratio_to_raw"]["status"],
        ),
    ]
    other = e2e["cpu_s"].get("other", 0.0)
    other_share = other / ((m["cpu_count"] or 1) * e2e["seconds"]) if e2e["seconds"] else 0.0
    warning = (
        [
            f"WARNING: other processes on this machine used {other:.1f} CPU-s during the end-to-end run "
            f"({other_share:.0%} of the machine): the figures are lower than this machine can do.",
            "",
        ]
        if other_share > OTHER_LOAD_WARNING and other > 0.5
        else []
    )
    cpu = ", ".join(f"{k} {raw['cpu_s'].get(k, 0):.2f} | {v:.2f}" for k, v in e2e["cpu_s"].items())
    return "\n".join(
        [
            f"ingest: {c['groups']:,} groups x {c['group_size']} trajectories "
            f"(~{p['trajectory_bytes_mean']:,} B each, {p['group_bytes_mean']:,} B a group), "
            f"in flight <= {c['max_in_flight']}, "
            f"warm-up {c['warmup_groups']} groups, collector processes: {c['collector_processes']}"
            + ("  [--quick: a smoke test, not a measurement]" if c["quick"] else ""),
            f"machine: {m['cpu_count']} CPUs (load {m['load_average_1m_before']} before), "
            f"Python {m['python']}, {m['nats_server']}, PostgreSQL {m['postgres']}",
            f"durability: PostgreSQL durable={d['postgres_durable']} (fsync={d['postgres_fsync']}, "
            f"synchronous_commit={d['postgres_synchronous_commit']}); "
            f"JetStream {d['jetstream_storage']} store",
            "",
            *table(figures, right={1, 2}),
            "",
            f"CPU seconds (one raw run | end to end): {cpu}",
            "",
            *warning,
            *table(goal_rows, right={1, 2}),
        ]
    )


def parse_args(argv: list[str]) -> Config:
    parser = harness.parser("ingest", __doc__)
    parser.add_argument("--groups", type=int, help=f"groups measured (default {DEFAULT_GROUPS})")
    parser.add_argument("--group-size", type=int, default=DEFAULT_GROUP_SIZE, help="trajectories a group")
    parser.add_argument("--warmup-groups", type=int, help=f"default {DEFAULT_WARMUP_GROUPS}")
    parser.add_argument("--max-in-flight", type=int, default=DEFAULT_MAX_IN_FLIGHT, help="unacked publishes")
    parser.add_argument(
        "--raw-runs", type=int, help=f"raw publish runs, the median is reported (default {DEFAULT_RAW_RUNS})"
    )
    parser.add_argument(
        "--light-groups",
        type=int,
        help=f"groups published one at a time for the light-load latency (default {DEFAULT_LIGHT_GROUPS})",
    )
    parser.add_argument(
        "--collectors", type=int, default=1, help="collector processes sharing the durable consumer"
    )
    parser.add_argument("--timeout", type=float, default=120.0, help="longest wait for group.ready events")
    parser.add_argument(
        "--quick", action="store_true", help=f"a tiny run ({QUICK_GROUPS} groups): a smoke test"
    )
    parser.add_argument(
        "--no-durable",
        dest="durable",
        action="store_false",
        help="PostgreSQL with fsync off (default: durable)",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    groups = args.groups or (QUICK_GROUPS if args.quick else DEFAULT_GROUPS)
    warmup = args.warmup_groups
    if warmup is None:
        warmup = QUICK_WARMUP_GROUPS if args.quick else DEFAULT_WARMUP_GROUPS
    raw_runs = args.raw_runs or (1 if args.quick else DEFAULT_RAW_RUNS)
    light = (
        args.light_groups if args.light_groups is not None else (5 if args.quick else DEFAULT_LIGHT_GROUPS)
    )
    if (
        min(groups, args.group_size, args.max_in_flight, raw_runs, args.collectors) < 1
        or min(warmup, light) < 0
    ):
        parser.error(
            "--groups, --group-size, --max-in-flight, --raw-runs and --collectors must be positive, "
            "--warmup-groups and --light-groups >= 0"
        )
    return Config(
        groups=groups,
        group_size=args.group_size,
        warmup_groups=warmup,
        max_in_flight=args.max_in_flight,
        collectors=args.collectors,
        raw_runs=raw_runs,
        light_groups=light,
        quick=args.quick,
        timeout_s=args.timeout,
        durable=args.durable,
        seed=args.seed,
        output=args.output,
    )


def main(argv: list[str] | None = None) -> dict:
    config = parse_args(argv_of(argv))
    with collector_stack(config.durable, config.collectors) as stack:
        result = asyncio.run(run(config, stack))
    return report(result, render, config.output)


if __name__ == "__main__":
    main()
