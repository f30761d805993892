"""Serving comparison: every way of serving SmolLM2 here, under one client load, in one run.

Contenders, each asked the same thing: rounds of ``--concurrency`` (32) distinct chats sent at
once, ``max_tokens`` 48, temperature 1, ``logprobs`` on (as a trainer's agent asks; Artery's
replicas compute them always), after one warm-up round each:

- ``hf_generate``: Hugging Face ``model.generate`` in this process, float32, one batched call a
  round (no HTTP, no logprobs): the floor any server should beat;
- ``artery_transformers``: Artery's replica on the transformers engine (the fallback);
- ``artery_vllm``: Artery's replica on the vLLM engine at the engine's own defaults, and
  ``vllm_serve``: vLLM's OpenAI server with those same engine arguments (read from the engine);
- ``artery_default``: Artery's replica as the default serving path runs it
  (``default_serving_env``), and ``vllm_serve_lora``: vLLM's server with that replica's engine
  arguments (bf16, LoRA enabled at the same max rank) less any that load Artery's own code (a
  worker extension): vLLM's own LoRA serving, the like-for-like baseline of a LoRA-serving path;
- ``vllm_cpu_best``: vLLM-CPU's fastest own server on this CPU (``BEST_DTYPE``, no LoRA, ``BEST_CPU``,
  chosen with ``--sweep``).

Only one contender is under load at a time: the contenders of a phase take turns round by
round (a burst of other load hits all of them alike) and each ratio comes from a phase holding
both of its sides. Servers are started once, before the first phase that needs them (those of a
phase together, while nothing is measured), and stopped after the last one; at most two vLLM
servers are up at once, the idle one waiting. The CPU each contender's processes used in a phase
and what the rest of the machine used meanwhile are recorded, with the load average.

The figures go into ``loadtests/results/inference.json`` beside the inference benchmark's:
``serving`` (everything) and the ratios ``vllm_vs_vllm_serve``, ``default_vs_best_cpu``,
``default_vs_vllm_serve_lora``, ``default_vs_hf_generate`` (tokens/s, the first side over the
second).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import functools
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from artery.ops.stack import Stack
from artery.shared.cpu import cpu_has_bf16
from artery.shared.models import SMOLLM2, resolve_base_model
from loadtests import RESULTS_DIR, harness
from loadtests.chat_client import Round, chat_round, prompts
from loadtests.harness import STOP_TIMEOUT_S, argv_of, gpu_present, load_average, machine, table, tail
from loadtests.serving_result import (
    IN_PROCESS,
    KEPT,
    KEYS,
    RATIOS,
    assemble,
    figures,
    merge_into,
    phases_for,
    plan,
    render,
)
from loadtests.serving_servers import MODEL, SWEEP, Contender, Servers, contenders, default_serving_env

__all__ = ["KEPT", "KEYS", "default_serving_env", "main"]

# --- the run --------------------------------------------------------------------------------------


@dataclass
class Config:
    base_model: str
    concurrency: int
    rounds: int
    max_tokens: int
    only: list[str]
    #: Candidate numbers of ``--sweep`` ([] for every one), or None: the comparison.
    sweep: list[int] | None
    quick: bool
    output: Path
    #: torch threads of generate() here and of the transformers replica (None: torch's default).
    threads: int | None = None


#: The longest a turn waits for the other servers to go idle (vLLM's own poll lasts a second).
IDLE_TIMEOUT_S = 10.0


class Clock:
    """Progress lines with the time since the run began (vLLM servers take minutes to start)."""

    def __init__(self) -> None:
        self.started = time.monotonic()

    def say(self, text: str) -> None:
        print(f"[{time.monotonic() - self.started:6.0f} s] {text}", flush=True)


def _cpu(servers: Servers, names: tuple[str, ...]) -> dict[str, float]:
    # This process alone (the client, and generate() when it runs here): the servers are its
    # children, counted apart, each with its own children (a vLLM server's engine core).
    out = {"machine": harness.machine_busy_s(), "benchmark": harness.proc_cpu_s(os.getpid())}
    for name in names:
        if name not in IN_PROCESS:
            pid = servers.pid(name)
            out[name] = harness.tree_cpu_s(pid) if pid else 0.0
    return out


class Turns:
    """Each contender's turn begins once the phase's other servers are idle (``until_idle``):
    the one before may still be computing after its last answer (vLLM's worker polls for a
    second), on the cores the next one is timed on. The in-process ``generate()`` has no server."""

    def __init__(self, servers: Servers, phase: tuple[str, ...]) -> None:
        self.pids = {name: servers.pid(name) for name in phase if name not in IN_PROCESS}
        self.waited_s = 0.0
        self.not_idle = 0

    async def before(self, name: str) -> None:
        others = [pid for other, pid in self.pids.items() if other != name and pid]
        if not others:
            return
        quiet = await harness.until_idle(others, timeout_s=IDLE_TIMEOUT_S)
        self.waited_s += quiet.waited_s
        self.not_idle += not quiet.settled


async def measure_phase(phase: tuple[str, ...], servers: Servers, hf, config: Config, clock: Clock) -> dict:
    """One warm-up round each, then ``rounds`` rounds taking turns."""
    batch = prompts(config.concurrency)
    limits = httpx.Limits(max_connections=config.concurrency, max_keepalive_connections=config.concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        runs: dict[str, Callable[[], Awaitable[Round]]] = {}
        for name in phase:
            if name == "hf_generate":

                async def hf_round() -> Round:  # blocks the loop, which has nothing else to do
                    r = hf.round(batch, config.max_tokens)
                    return Round(r.seconds, r.tokens)

                runs[name] = hf_round
            else:
                runs[name] = functools.partial(
                    chat_round, client, servers.urls[name], MODEL, batch, config.max_tokens, logprobs=True
                )
        turns = Turns(servers, phase)
        for name, run in runs.items():
            await turns.before(name)
            warm = await run()
            clock.say(f"  warm-up {name}: {warm.tokens / warm.seconds:,.1f} tokens/s")
        load_before = load_average()
        before, started = _cpu(servers, phase), time.perf_counter()
        rounds: dict[str, list[Round]] = {name: [] for name in phase}
        for i in range(config.rounds):
            for name, run in runs.items():
                await turns.before(name)
                r = await run()
                rounds[name].append(r)
            clock.say(
                f"  round {i + 1}/{config.rounds}: "
                + ", ".join(f"{n} {rs[-1].tokens / rs[-1].seconds:,.1f}" for n, rs in rounds.items())
                + " tokens/s"
            )
        seconds, after = time.perf_counter() - started, _cpu(servers, phase)
    cpu = {name: round(after[name] - before[name], 2) for name in after if name != "machine"}
    busy = after["machine"] - before["machine"]
    cpu["other"] = round(max(0.0, busy - sum(cpu.values())), 2)
    cores = os.cpu_count() or 1
    return {
        "contenders": list(phase),
        "load_average_1m_before": load_before,
        "seconds": round(seconds, 1),
        "cpu_s": cpu,
        "other_share": round(cpu["other"] / (cores * seconds), 3) if seconds else 0.0,
        "figures": {name: figures(rs, config.concurrency) for name, rs in rounds.items()},
        # Before each turn, the other servers went idle (``Turns``): the seconds that took, and the
        # turns that began with one still busy after ``IDLE_TIMEOUT_S``.
        "idle_wait_s": round(turns.waited_s, 1),
        "turns_not_idle": turns.not_idle,
    }


def bring_up(
    servers: Servers,
    cast: list[Contender],
    *,
    one_at_a_time: bool,
    meanwhile: Callable[[], None],
    say: Callable[[str], None],
) -> None:
    """Start ``cast``'s servers and wait until each serves, doing ``meanwhile`` as they load.

    On a GPU they start one at a time: a vLLM server sizes its KV cache from the GPU memory that
    goes while it profiles, so a neighbour loading its model at the same moment is counted as
    its own (vLLM issue 55827): the cache shrinks, or the engine core fails at start. On the CPU
    they load side by side."""

    def up(c: Contender) -> None:
        servers.wait(c.name)
        say(f"  {c.name} up at {servers.urls[c.name]}")

    for c in cast:
        servers.start(c)
        if one_at_a_time:
            up(c)
    meanwhile()
    for c in cast if not one_at_a_time else ():
        up(c)


def run_phases(config: Config, phases: tuple[tuple[str, ...], ...], cast: dict[str, Contender]) -> list[dict]:
    clock = Clock()
    measured = []
    hf = None
    with tempfile.TemporaryDirectory(prefix="artery-bench-serving-") as home:
        stack = Stack(home=Path(home), services=())
        servers = Servers(stack, config.base_model, Path(home))
        one_at_a_time = gpu_present()

        def load_hf(phase: tuple[str, ...]) -> None:
            nonlocal hf
            if "hf_generate" in phase and hf is None:
                from loadtests.inference import HFBaseline

                hf = HFBaseline(resolve_base_model(config.base_model), config.threads)

        try:
            stack.start_infrastructure()
            for i, step in enumerate(plan(phases), 1):
                if step.start:
                    clock.say(f"phase {i}: starting {', '.join(step.start)}")
                bring_up(
                    servers,
                    [cast[name] for name in step.start],
                    one_at_a_time=one_at_a_time,
                    meanwhile=functools.partial(load_hf, step.phase),
                    say=clock.say,
                )
                clock.say(f"phase {i}: {' / '.join(step.phase)}, {config.rounds} rounds")
                measured.append(asyncio.run(measure_phase(step.phase, servers, hf, config, clock)))
                for name in step.stop_after:
                    servers.stop(name)
        except BaseException:
            for name in [*stack.processes, *servers.popen]:
                if lines := tail(servers.log(name), 60):
                    print(f"{name} log (last lines):\n{lines}", file=sys.stderr)
            raise
        finally:
            servers.stop_all()
            for process in stack.processes.values():
                process.stop(timeout=STOP_TIMEOUT_S)
            stack.stop()
    return measured


def sweep(config: Config) -> dict:
    """``SWEEP``'s candidates for vLLM-CPU's fastest server (all, or those numbered in
    ``--sweep``), two at a time taking turns round by round, the pairs back to back."""
    picked = config.sweep or list(range(1, len(SWEEP) + 1))
    labels = list(SWEEP)
    cast = {
        f"candidate_{i}": Contender(f"candidate_{i}", labels[i - 1], serve=SWEEP[labels[i - 1]])
        for i in picked
    }
    names = list(cast)
    phases = tuple(tuple(names[i : i + 2]) for i in range(0, len(names), 2))
    measured = run_phases(config, phases, cast)
    rows: list[tuple[str, ...]] = [("candidate", "tokens/s", "median round", "flags")]
    out = {}
    for phase in measured:
        for name, f in phase["figures"].items():
            serve = cast[name].serve
            flags = serve.describe() if serve else ""
            out[cast[name].what] = {
                "flags": flags,
                "load_average_1m_before": phase["load_average_1m_before"],
                **f,
            }
            rows.append(
                (
                    cast[name].what,
                    f"{f['tokens_per_s']:,.1f}",
                    f"{f['median_round_tokens_per_s']:,.1f}",
                    flags,
                )
            )
    print("\n".join(table(rows, right={1, 2})), flush=True)
    return out


def parse_args(argv: list[str]) -> Config:
    parser = harness.parser("serving", __doc__ or "")
    parser.set_defaults(output=RESULTS_DIR / "inference.json")
    parser.add_argument("--base-model", default=SMOLLM2, help=f"weights (default {SMOLLM2})")
    parser.add_argument("--concurrency", type=int, default=32, help="chats sent at once (default 32)")
    parser.add_argument("--rounds", type=int, help="timed rounds per phase (default 5; --quick 1)")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument(
        "--only", action="append", choices=list(RATIOS), default=[], help="measure only this ratio's phase"
    )
    parser.add_argument(
        "--sweep",
        nargs="*",
        type=int,
        help="instead: the candidates for vLLM-CPU's fastest own server (numbers from 1: those only)",
    )
    parser.add_argument("--quick", action="store_true", help="one round per phase: a smoke test")
    parser.add_argument(
        "--threads",
        type=int,
        help="torch threads of generate() here and of the transformers replica (default: torch's, every "
        "core; 1 holds up better while other work shares the cores)",
    )
    args = parser.parse_args(argv)
    rounds = args.rounds if args.rounds is not None else (1 if args.quick else 5)
    if min(rounds, args.concurrency, args.max_tokens) < 1:
        parser.error("--rounds, --concurrency and --max-tokens must be positive")
    if any(not 1 <= n <= len(SWEEP) for n in args.sweep or []):
        parser.error(f"--sweep: candidates are numbered 1 to {len(SWEEP)}")
    return Config(
        args.base_model,
        args.concurrency,
        rounds,
        args.max_tokens,
        args.only,
        args.sweep,
        args.quick,
        args.output,
        args.threads,
    )


def main(argv: list[str] | None = None) -> dict:
    config = parse_args(argv_of(argv))
    settings = {
        "base_model": config.base_model,
        "concurrency": config.concurrency,
        "rounds": config.rounds,
        "max_tokens": config.max_tokens,
        "temperature": 1.0,
        "logprobs": True,
        "quick": config.quick,
        "torch_threads": config.threads or "default (every core)",
        "cpu_bf16": cpu_has_bf16(),
        "default_serving_env": default_serving_env(config.base_model),
    }
    load_before = load_average()
    if config.sweep is not None:
        candidates = sweep(config)
        measured = {
            "serving_sweep": {"config": settings, "machine": machine(load_before), "candidates": candidates}
        }
        return merge_into(config.output, measured)
    phases = phases_for(config.only)
    cast = contenders(config.base_model, {n for p in phases for n in p}, config.threads)
    measured_phases = run_phases(config, phases, cast)
    info = machine(load_before, measured_at=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"))
    measured = assemble(measured_phases, {n: c.describe() for n, c in cast.items()}, settings, info)
    print(render(measured["serving"]), flush=True)
    result = merge_into(config.output, measured)
    print(f"\nwritten to {config.output}", flush=True)
    return result


if __name__ == "__main__":
    main()
