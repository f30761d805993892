"""What every benchmark shares, so that each benchmark module reads as what it measures.

- the run: ``argv_of``, ``parser`` (a benchmark's arguments with ``--output``), ``collector_stack``
  (the private servers and collector(s) that ingest and soak measure), ``stopping`` (a
  ``LocalBackend``'s services drained and stopped after a run), ``tail`` of a log;
- the result: ``load_average`` and ``machine`` (under what the figures were taken), ``report``
  (print the table, write the JSON), ``table``, ``percentile``, ``summary_ms``, ``version``;
- where the CPU went: ``CpuMeter``, ``proc_cpu_s``, ``tree_cpu_s``, ``machine_busy_s`` (Linux ``/proc``),
  and ``until_idle`` (servers that stopped computing before another one's turn is timed);
- realistic wire objects: ``build_trajectory``, ``build_group`` (also the tests' factories).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from artery.ops.stack import ServiceProcess, Stack
from artery.schemas import Message, Sample, Trajectory, TrajectoryGroupSubmitted, new_event_id
from artery.shared.embedded import postgres_bin_dir
from loadtests import RESULTS_DIR

#: A service slow to exit on SIGTERM once the figures are taken is killed after this, not waited for.
STOP_TIMEOUT_S = 3.0


# --- the run --------------------------------------------------------------------------------


def argv_of(argv: list[str] | None) -> list[str]:
    """The arguments of a benchmark's ``main``: given, or the command line's."""
    return list(sys.argv[1:] if argv is None else argv)


def parser(name: str, doc: str, prog: str | None = None) -> argparse.ArgumentParser:
    """A benchmark's parser: described by its docstring's first line, with ``--output``."""
    out = argparse.ArgumentParser(prog=prog or f"python -m loadtests {name}", description=doc.splitlines()[0])
    out.add_argument("--output", type=Path, default=RESULTS_DIR / f"{name}.json", help="JSON result file")
    return out


def tail(path: Path, lines: int = 20) -> str:
    """The last lines of a log, for the message of a failed run ('' where there is none)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


@contextlib.contextmanager
def collector_stack(durable: bool, collectors: int = 1, prefix: str = "artery-bench-") -> Iterator[Stack]:
    """A private nats-server and PostgreSQL under a temporary directory, with ``collectors``
    collector processes sharing the durable consumer, stopped on the way out (the collector's log
    printed when the run fails)."""
    with tempfile.TemporaryDirectory(prefix=prefix) as home:
        stack = Stack(home=Path(home), services=("collector",), durable=durable)
        postgres_bin_dir()  # fail early, with the package's message, when PostgreSQL is missing
        try:
            stack.start()
            for i in range(2, collectors + 1):
                replica = ServiceProcess("collector", stack.service_env(), stack.logs / f"collector-{i}.log")
                replica.start()
                stack.processes[f"collector-{i}"] = replica
                replica.wait_ready()
            yield stack
        except BaseException:
            print(f"collector log (last lines):\n{tail(stack.logs / 'collector.log')}", file=sys.stderr)
            raise
        finally:
            # The rows are verified by now: a collector slow to exit is killed rather than waited for.
            for process in stack.processes.values():
                process.stop(timeout=STOP_TIMEOUT_S)
            stack.stop()


@contextlib.asynccontextmanager
async def stopping(backend: Any, log_lines: int = 15) -> AsyncIterator[Any]:
    """Runs the body with a ``LocalBackend``; on the way out every service is sent SIGTERM at once
    (each drains on its own, not one after the other), then the backend and its servers stop, also
    after a start that failed half-way. A failed run prints each service's last log lines."""
    try:
        yield backend
    except BaseException:
        for name, process in backend.stack.processes.items():
            print(f"{name} log (last lines):\n{tail(process.log_path, log_lines)}", file=sys.stderr)
        raise
    finally:
        for process in backend.stack.processes.values():
            process.signal(signal.SIGTERM)
        await backend.close()
        await asyncio.to_thread(backend.stack.stop)


# --- the result -----------------------------------------------------------------------------


def sync_device(device: str) -> None:
    """Wait for the GPU's queued work, so that a timer around a step times the step (CUDA runs
    asynchronously); nothing on the CPU."""
    if device.startswith("cuda"):
        import torch  # only the benchmarks that train need torch

        torch.cuda.synchronize()


def gpu_present() -> bool:
    """Whether a CUDA GPU is here (vLLM serves on it, not on the CPU)."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


def load_average() -> float | None:
    """The 1-minute load average (what else was running shapes every figure), where there is one."""
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def machine(load_before: float | None, **extra: Any) -> dict:
    """The ``machine`` block of a result: where and under what load the figures were taken."""
    return {
        "cpu_count": os.cpu_count(),
        "load_average_1m_before": load_before,
        "platform": platform.platform(),
        "python": platform.python_version(),
        **extra,
    }


def report(result: dict, render: Callable[[dict], str], output: Path) -> dict:
    """Print the benchmark's table and keep its figures as JSON."""
    print(render(result), flush=True)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwritten to {output}", flush=True)
    return result


def table(rows: list[tuple[str, ...]], right: set[int]) -> list[str]:
    """Rows as aligned columns; the columns numbered in ``right`` are right-aligned."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(v.rjust(widths[i]) if i in right else v.ljust(widths[i]) for i, v in enumerate(r)).rstrip()
        for r in rows
    ]


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def summary_ms(seconds: list[float]) -> dict[str, float]:
    """Count, min, p50, p99 and max of durations given in seconds, in milliseconds."""
    ms = [s * 1000 for s in seconds]
    return {
        "n": len(ms),
        "min": round(min(ms), 2),
        "p50": round(percentile(ms, 50), 2),
        "p99": round(percentile(ms, 99), 2),
        "max": round(max(ms), 2),
    }


def version(cmd: list[str]) -> str:
    """What a program says its version is ('unknown' where it cannot be run)."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# --- where the CPU went ---------------------------------------------------------------------


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process (Linux ``/proc``); 0 where unreadable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return out


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of a process and its descendants (a vLLM server's engine core is a child)."""
    return sum(proc_cpu_s(p) for p in process_tree(pid))


def process_tree(pid: int) -> list[int]:
    """A process and its descendants, as they are now."""
    return [pid, *(p for child in _children(pid) for p in process_tree(child))]


#: ``until_idle``: the window over which a server counts as idle, and what it may use in it.
IDLE_WINDOW_S, IDLE_CORE_SHARE = 0.2, 0.1


@dataclass(frozen=True)
class Quiet:
    """What ``until_idle`` waited: seconds, and whether the servers went idle within its limit."""

    waited_s: float
    settled: bool


async def until_idle(pids: list[int], timeout_s: float = 10.0) -> Quiet:
    """Wait until the processes ``pids`` (with their descendants) use at most ``IDLE_CORE_SHARE``
    of a core over ``IDLE_WINDOW_S``, or ``timeout_s`` has passed.

    Why: contenders timed in turns share the cores, and a server may go on computing after its
    last answer: vLLM's worker polls its queue for a second after its last batch (vLLM's
    ``SpinCondition``), taking a core from whichever contender's round comes next. Reading the
    servers' CPU time is the only signal of that; nothing announces it."""
    tree = [p for pid in pids for p in process_tree(pid)]
    started = time.monotonic()
    used = sum(proc_cpu_s(p) for p in tree)
    while True:
        await asyncio.sleep(IDLE_WINDOW_S)  # the window the CPU time is read over
        waited = time.monotonic() - started
        now = sum(proc_cpu_s(p) for p in tree)  # this window's end is the next one's start
        if now - used <= IDLE_CORE_SHARE * IDLE_WINDOW_S:
            return Quiet(waited, True)
        if waited >= timeout_s:
            return Quiet(waited, False)
        used = now


def machine_busy_s() -> float:
    """CPU seconds the whole machine spent busy (all cores, everything but idle and iowait)."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0.0
    busy = sum(fields[:8]) - fields[3] - fields[4]  # user..steal, less idle and iowait
    return busy / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """CPU seconds spent by each part of the run (benchmark client, nats-server, services,
    PostgreSQL with its backends) between two snapshots: where a 2-core machine's time goes."""

    def __init__(self, stack: Stack):
        self.parts: dict[str, list[int]] = {"benchmark": [os.getpid()]}
        if stack.nats and stack.nats.proc:
            self.parts["nats-server"] = [stack.nats.proc.pid]
        for process in stack.processes.values():  # replicas of a service count together
            if process.proc:
                service = getattr(process, "service", "") or process.name
                self.parts.setdefault(service, []).append(process.proc.pid)
        self.postgres_pid = stack.postgres.proc.pid if stack.postgres and stack.postgres.proc else None

    def snapshot(self) -> dict[str, float]:
        parts = dict(self.parts)
        if self.postgres_pid:
            parts["postgres"] = [self.postgres_pid, *_children(self.postgres_pid)]
        out = {name: sum(proc_cpu_s(pid) for pid in pids) for name, pids in parts.items()}
        out["machine"] = machine_busy_s()
        return out

    @staticmethod
    def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
        """CPU seconds per part; ``other`` is what the rest of the machine used meanwhile."""
        out = {k: after[k] - before.get(k, 0.0) for k in after if k != "machine"}
        out["other"] = max(0.0, after["machine"] - before["machine"] - sum(out.values()))
        return {k: round(v, 2) for k, v in out.items()}


# --- realistic wire objects -----------------------------------------------------------------


def build_trajectory(rng: random.Random, reward: float, turns: int = 5) -> Trajectory:
    """About 2 KB with 10 messages: a system prompt, then user/assistant turns with samples."""
    messages = [Message(role="system", content="You are a careful assistant. " * 4)]
    for turn in range(turns):
        messages.append(Message(role="user", content=f"Question {turn}: what is {rng.randint(1, 99)} + 7?"))
        ids = [rng.randrange(1000) for _ in range(12)]
        messages.append(
            Message(
                role="assistant",
                content=f"<answer>{rng.randint(1, 120)}</answer>",
                sample=Sample(token_ids=ids, logprobs=[-rng.random() for _ in ids], finish_reason="stop"),
            )
        )
    return Trajectory(messages=messages[: 2 * turns], reward=reward, metrics={"turns": turns})


def build_group(
    project: str, model: str, size: int, seed: int, rng_of: Callable[[int], random.Random] | None = None, **kw
) -> TrajectoryGroupSubmitted:
    """A group of ``size`` such trajectories, rewards 0, 1/size, ...; one random stream for the
    group unless ``rng_of(i)`` gives each trajectory its own."""
    rng = random.Random(seed)
    return TrajectoryGroupSubmitted(
        id=new_event_id(),
        project=project,
        model=model,
        trajectories=[build_trajectory(rng_of(i) if rng_of else rng, reward=i / size) for i in range(size)],
        **kw,
    )
