"""Control-plane benchmark: many inference replicas of many models on one NATS server, paused.

What runs: a private nats-server (``--cluster``: the 3-node cluster of ``artery.testing.cluster``,
streams and buckets with 3 replicas), provisioned as the services provision it, and ``--replicas``
simulated replicas spread evenly over ``--models`` models, in ``--hosts`` processes. A simulated
replica is the replica side of the control protocol exactly as the inference service wires it
(``services/inference/main.py``), with its own classes from ``services/inference/control.py``:
a ``PauseGate`` with no engine behind it, a ``ControlServer`` answering pause and resume on its
model's subjects (calling the registry's ``beat`` after each), and a ``ReplicaRegistry`` putting
its heartbeat into the replicas bucket every ``--heartbeat-s``; each replica has a NATS
connection of its own, as a real one does. No HTTP server and no model: what is measured is the
control plane alone.

The trainer side runs in this process with the trainer's own client (``shared/control_client.py``),
on a connection of its own:

- ``pause`` (one model at a time, ``--rounds`` times over every model): ``pause_replicas`` then
  ``resume_replicas``. ``pause_acked_ms``: from the pause request's publish until the last replica
  of the model has acked (``PauseOutcome.elapsed_s``); ``pause_call_ms``: the whole call, the read
  of the model's live replicas from the bucket included; the same for resume;
- ``concurrent``: every model paused at once (as many trainers as models), then resumed, per round;
- ``registry_reads``: listing one model's live replicas, and the whole bucket (the console's read);
- ``traffic``: a tap connection counts messages and bytes on the replicas bucket's subjects
  (heartbeats, and the beats after each pause/resume), the control subjects (the requests), the
  trainer's inbox (acks and registry reads delivered) and the JetStream API, first with nothing
  but heartbeats (``--idle-s``), then over the pause rounds.

Every pause must be acked by every replica of its model: ``failures`` counts those that were not.

Long module: one benchmark, read top to bottom: the simulated replicas and their hosts, the
trainer side, the result and its table. What every benchmark shares is ``loadtests/harness.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import nats

from artery.services.inference.control import ControlServer, ReplicaRegistry
from artery.services.inference.pause import PauseGate
from artery.shared import bus, subjects
from artery.shared.control_client import live_replicas, pause_replicas, registered_replicas, resume_replicas
from artery.shared.embedded import NatsServer, nats_server_binary
from artery.shared.logs import setup_logging
from artery.shared.settings import CommonSettings
from loadtests import harness
from loadtests.harness import argv_of, load_average, machine, report, summary_ms, table

PROJECT = "bench"
#: The trainer's inbox prefix here, so that the tap tells its replies from the replicas'.
TRAINER_INBOX = "_INBOX_TRAINER"
LEASE_S = 30.0
#: Seconds the replicas bucket may take to list every replica once the hosts are up.
REGISTERED_TIMEOUT_S = 60.0
ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True, kw_only=True)
class Config:
    replicas: int
    models: int
    hosts: int
    heartbeat_s: float
    idle_s: float
    rounds: int
    cluster: bool
    quick: bool
    output: Path


def model_name(index: int) -> str:
    return f"m{index:02d}"


def assignments(config: Config) -> list[list[tuple[str, str]]]:
    """(model, replica id) per host: each model's replicas spread over the hosts."""
    hosts: list[list[tuple[str, str]]] = [[] for _ in range(config.hosts)]
    for i in range(config.replicas):
        model = model_name(i % config.models)
        hosts[i % config.hosts].append((model, f"sim-{model}-{i // config.models:03d}"))
    return hosts


# --------------------------------------------------------------------------- the replicas


class SimulatedReplica:
    """The inference service's control side (gate, control server, registry), without an engine."""

    def __init__(self, url: str, model: str, replica_id: str, heartbeat_s: float):
        self.url, self.model, self.replica_id, self.heartbeat_s = url, model, replica_id, heartbeat_s
        self.nc: nats.NATS | None = None

    async def start(self) -> None:
        self.nc = await nats.connect(servers=self.url.split(","), name=self.replica_id)
        gate = PauseGate()
        self.registry = ReplicaRegistry(
            self.nc.jetstream(),
            gate,
            replica_id=self.replica_id,
            project=PROJECT,
            model=self.model,
            engine="simulated",
            url=f"http://{self.replica_id}.invalid",
            heartbeat_s=self.heartbeat_s,
        )
        self.control = ControlServer(
            self.nc,
            gate,
            replica_id=self.replica_id,
            project=PROJECT,
            model=self.model,
            on_change=self.registry.beat,
        )
        await self.control.start()
        await self.registry.start()

    async def stop(self) -> None:
        await self.control.stop()
        await self.registry.stop()
        if self.nc is not None:
            await self.nc.close()


def host_main() -> None:
    """A host process (``python -m loadtests.control_plane --host``): its replicas from the first
    line of stdin, ``ready <n>`` on stdout once they run, stopped when stdin closes."""
    setup_logging("inference", level="warning", fmt="console")  # a pause's info lines, times 100
    spec = json.loads(sys.stdin.readline())
    asyncio.run(_host(spec["url"], [tuple(r) for r in spec["replicas"]], spec["heartbeat_s"]))


async def _host(url: str, replicas: list[tuple[str, str]], heartbeat_s: float) -> None:
    running = [SimulatedReplica(url, model, rid, heartbeat_s) for model, rid in replicas]
    try:
        for replica in running:
            await replica.start()
        print(f"ready {len(running)}", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until EOF
    finally:
        for replica in running:
            with contextlib.suppress(Exception):
                await replica.stop()


class Hosts:
    """The replica host processes; each stops when its stdin closes (also when this one dies)."""

    def __init__(self, url: str, config: Config):
        self.url, self.config = url, config
        self.processes: list[subprocess.Popen] = []

    def start(self) -> int:
        for share in assignments(self.config):
            process = subprocess.Popen(
                [sys.executable, "-m", "loadtests.control_plane", "--host"],
                cwd=ROOT,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            self.processes.append(process)
            assert process.stdin is not None
            spec = {"url": self.url, "replicas": share, "heartbeat_s": self.config.heartbeat_s}
            process.stdin.write(json.dumps(spec) + "\n")
            process.stdin.flush()
        started = 0
        for process in self.processes:
            assert process.stdout is not None
            ready, _, count = process.stdout.readline().partition(" ")  # blocks until it is up
            if ready != "ready":
                raise RuntimeError(f"replica host {process.pid} exited with {process.wait()} before ready")
            started += int(count)
        return started

    def stop(self) -> None:
        for process in self.processes:
            with contextlib.suppress(OSError):
                assert process.stdin is not None
                process.stdin.close()
        for process in self.processes:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


# --------------------------------------------------------------------------- the trainer side


class Tap:
    """Messages and bytes per kind of subject, seen by a connection of its own."""

    KINDS = {
        "heartbeats": f"$KV.{subjects.REPLICAS_BUCKET}.>",
        "control_requests": f"{subjects.PREFIX}.control.>",
        "trainer_inbox": f"{TRAINER_INBOX}.>",
        "jetstream_api": "$JS.API.>",
    }

    def __init__(self, nc: nats.NATS):
        self.nc = nc
        self.msgs: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()

    async def start(self) -> None:
        for kind, subject in self.KINDS.items():

            async def count(msg, kind=kind) -> None:
                self.msgs[kind] += 1
                self.bytes[kind] += len(msg.data)

            await self.nc.subscribe(subject, cb=count)
        await self.nc.flush()

    def snapshot(self) -> tuple[float, Counter[str], Counter[str]]:
        return time.monotonic(), Counter(self.msgs), Counter(self.bytes)

    @staticmethod
    def rates(before: tuple[float, Counter[str], Counter[str]], after: tuple) -> dict[str, Any]:
        seconds = after[0] - before[0]
        out: dict[str, Any] = {"seconds": round(seconds, 2)}
        for kind in Tap.KINDS:
            msgs, size = after[1][kind] - before[1][kind], after[2][kind] - before[2][kind]
            out[kind] = {
                "msgs": msgs,
                "msgs_per_s": round(msgs / seconds, 1),
                "bytes_per_s": round(size / seconds),
                "bytes_per_msg": round(size / msgs) if msgs else 0,
            }
        return out


async def wait_registered(js, expected: int, timeout_s: float) -> int:
    """Until the replicas bucket lists every replica (the registry is what the trainer reads)."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = len(await registered_replicas(js, f"{PROJECT}.>"))
        if found >= expected or time.monotonic() > deadline:
            return found
        await asyncio.sleep(0.2)  # polling the very read being measured: there is no event for it


async def pause_once(nc: nats.NATS, model: str, expected: int) -> dict[str, Any]:
    started = time.monotonic()
    try:
        outcome = await pause_replicas(
            nc, PROJECT, model, lease_seconds=LEASE_S, requested_by="bench", free_memory=False, timeout_s=10.0
        )
    except Exception as exc:  # PauseFailed names who did not ack
        return {"ok": False, "error": str(exc)[:300]}
    paused = time.monotonic()
    resumed = await resume_replicas(
        nc, PROJECT, model, outcome.lease_id, requested_by="bench", timeout_s=10.0
    )
    done = time.monotonic()
    ok = len(outcome.acked) == expected and not resumed.missing and not resumed.still_paused
    return {
        "ok": ok,
        "error": None
        if ok
        else f"{model}: {len(outcome.acked)}/{expected} paused, {resumed.missing} missing",
        "pause_acked_s": outcome.elapsed_s,
        "pause_call_s": paused - started,
        "resume_acked_s": resumed.elapsed_s,
        "resume_call_s": done - paused,
    }


async def measure(url: str, config: Config, started_replicas: int) -> dict[str, Any]:
    servers = url.split(",")
    nc = await nats.connect(servers=servers, name="trainer-bench", inbox_prefix=TRAINER_INBOX)
    tap_nc = await nats.connect(servers=servers, name="tap")
    try:
        js = nc.jetstream()
        registered = await wait_registered(js, config.replicas, REGISTERED_TIMEOUT_S)
        tap = Tap(tap_nc)
        await tap.start()
        before = tap.snapshot()
        await asyncio.sleep(config.idle_s)  # a measurement window: heartbeats only
        idle = Tap.rates(before, tap.snapshot())

        per_model = config.replicas // config.models
        reads_model, reads_all = [], []
        for i in range(config.models):
            t0 = time.monotonic()
            listed = await live_replicas(js, PROJECT, model_name(i))
            t1 = time.monotonic()
            everyone = await registered_replicas(js, f"{PROJECT}.>")
            reads_model.append(t1 - t0)
            reads_all.append(time.monotonic() - t1)
            assert len(listed) == per_model and len(everyone) == config.replicas, (len(listed), len(everyone))

        before = tap.snapshot()
        sequential = [
            await pause_once(nc, model_name(i), per_model)
            for _ in range(config.rounds)
            for i in range(config.models)
        ]
        during = Tap.rates(before, tap.snapshot())

        concurrent: list[dict[str, Any]] = []
        round_s = []
        for _ in range(config.rounds):
            t0 = time.monotonic()
            concurrent += await asyncio.gather(
                *(pause_once(nc, model_name(i), per_model) for i in range(config.models))
            )
            round_s.append(time.monotonic() - t0)
    finally:
        await nc.close()
        await tap_nc.close()

    def figures(runs: list[dict[str, Any]]) -> dict[str, Any]:
        good = [r for r in runs if r["ok"] or "pause_acked_s" in r]
        return {
            key.removesuffix("_s") + "_ms": summary_ms([r[key] for r in good])
            for key in ("pause_acked_s", "pause_call_s", "resume_acked_s", "resume_call_s")
        } | {"failures": sum(1 for r in runs if not r["ok"])}

    errors = [r["error"] for r in sequential + concurrent if not r["ok"]]
    return {
        "replicas_started": started_replicas,
        "replicas_registered": registered,
        "replicas_per_model": per_model,
        "pause": figures(sequential),
        "concurrent": {**figures(concurrent), "round_ms": summary_ms(round_s)},
        "registry_reads": {"one_model_ms": summary_ms(reads_model), "whole_bucket_ms": summary_ms(reads_all)},
        "traffic": {
            "idle": idle,
            "heartbeats_expected_per_s": round(config.replicas / config.heartbeat_s, 1),
            "during_pause_rounds": during,
        },
        "failures": len(errors),
        "errors": errors[:5],
    }


# --------------------------------------------------------------------------- the run


@contextlib.contextmanager
def nats_servers(home: Path, cluster: bool):
    """The URL(s) of a provisioned private nats-server, or of a 3-node cluster."""
    if cluster:
        from artery.testing.cluster import NatsCluster

        server: Any = NatsCluster(home / "cluster").start()
    else:
        server = NatsServer(home / "nats").start()
    try:
        settings = CommonSettings(nats_url=server.url, stream_replicas=3 if cluster else 1)

        async def provision() -> None:
            nc = await nats.connect(servers=server.url.split(","))
            try:
                await bus.provision(nc.jetstream(), settings)
            finally:
                await nc.close()

        asyncio.run(provision())
        yield server.url
    finally:
        server.stop()


def run(config: Config) -> dict[str, Any]:
    load_before = load_average()
    with (
        tempfile.TemporaryDirectory(prefix="artery-bench-control-") as home,
        nats_servers(Path(home), config.cluster) as url,
    ):
        hosts = Hosts(url, config)
        try:
            started = hosts.start()
            figures = asyncio.run(measure(url, config, started))
        finally:
            hosts.stop()
    return {
        "benchmark": "control_plane",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": machine(
            load_before,
            load_average_1m_after=load_average(),
            nats_server=harness.version([nats_server_binary(), "--version"]),
        ),
        "config": {
            **{k: v for k, v in asdict(config).items() if k != "output"},
            "nats": "3-node cluster, R3" if config.cluster else "one server",
            "lease_s": LEASE_S,
        },
        **figures,
    }


def render(result: dict[str, Any]) -> str:
    c, m = result["config"], result["machine"]
    rows: list[tuple[str, ...]] = [("per pause of one model's replicas", "n", "p50 ms", "p99 ms", "max ms")]
    for label, block in (("one at a time", result["pause"]), ("all models at once", result["concurrent"])):
        for key in ("pause_acked_ms", "pause_call_ms", "resume_acked_ms", "resume_call_ms"):
            s = block[key]
            name = f"{label}: {key.removesuffix('_ms').replace('_', ' ')}"
            rows.append((name, str(s["n"]), f"{s['p50']:.1f}", f"{s['p99']:.1f}", f"{s['max']:.1f}"))
    for key, s in result["registry_reads"].items():
        rows.append(
            (
                f"registry read: {key.removesuffix('_ms').replace('_', ' ')}",
                str(s["n"]),
                f"{s['p50']:.1f}",
                f"{s['p99']:.1f}",
                f"{s['max']:.1f}",
            )
        )
    traffic = result["traffic"]
    flows: list[tuple[str, ...]] = [
        ("traffic", "idle msgs/s", "idle bytes/s", "pausing msgs/s", "pausing bytes/s")
    ]
    for kind in Tap.KINDS:
        idle, busy = traffic["idle"][kind], traffic["during_pause_rounds"][kind]
        flows.append(
            (
                kind,
                f"{idle['msgs_per_s']}",
                f"{idle['bytes_per_s']}",
                f"{busy['msgs_per_s']}",
                f"{busy['bytes_per_s']}",
            )
        )
    return "\n".join(
        [
            f"control plane: {result['replicas_registered']}/{c['replicas']} replicas registered,"
            f" {c['models']} models ({result['replicas_per_model']} replicas each), {c['hosts']} host"
            f" processes, heartbeat every {c['heartbeat_s']}s, on {c['nats']}"
            + ("  [--quick]" if c["quick"] else ""),
            f"machine: {m['cpu_count']} CPUs, load {m['load_average_1m_before']} before,"
            f" {m['load_average_1m_after']} after; {m['nats_server']}",
            "",
            *table(rows, right={1, 2, 3, 4}),
            "",
            *table(flows, right={1, 2, 3, 4}),
            f"heartbeats expected: {traffic['heartbeats_expected_per_s']}/s;"
            f" failed pauses: {result['failures']}",
            *(f"  ! {error}" for error in result["errors"]),
        ]
    )


def parse_args(argv: list[str]) -> Config:
    parser = harness.parser("control_plane", __doc__)
    parser.add_argument("--replicas", type=int, default=100, help="simulated replicas in all (default 100)")
    parser.add_argument("--models", type=int, default=10, help="models they serve, evenly (default 10)")
    parser.add_argument("--hosts", type=int, default=4, help="processes the replicas run in (default 4)")
    parser.add_argument("--heartbeat-s", type=float, default=5.0, help="registry heartbeat (default 5)")
    parser.add_argument("--idle-s", type=float, help="heartbeat-only window (default 10; quick 5)")
    parser.add_argument("--rounds", type=int, help="pauses of every model (default 10; quick 3)")
    parser.add_argument("--cluster", action="store_true", help="a 3-node NATS cluster, R3 buckets")
    parser.add_argument("--quick", action="store_true", help="a shorter idle window and fewer rounds")
    args = parser.parse_args(argv)
    idle_s = args.idle_s if args.idle_s is not None else (5.0 if args.quick else 10.0)
    rounds = args.rounds or (3 if args.quick else 10)
    if min(args.replicas, args.models, args.hosts, rounds) < 1 or args.replicas % args.models:
        parser.error("counts must be positive, and --replicas a multiple of --models")
    if not 0 < args.heartbeat_s < 30 or idle_s <= 0:
        parser.error("--heartbeat-s must be in (0, 30) (entries expire after 30 s), --idle-s positive")
    return Config(
        replicas=args.replicas,
        models=args.models,
        hosts=min(args.hosts, args.replicas),
        heartbeat_s=args.heartbeat_s,
        idle_s=idle_s,
        rounds=rounds,
        cluster=args.cluster,
        quick=args.quick,
        output=args.output,
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    config = parse_args(argv_of(argv))
    return report(run(config), render, config.output)


if __name__ == "__main__":
    if sys.argv[1:] == ["--host"]:
        host_main()
    else:
        main()
