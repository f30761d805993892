"""The serving comparison's pure parts: which phases run and when each server starts and
stops, the figures of a contender's rounds, the ratios and the result written into
``inference.json``, and its table."""

from __future__ import annotations

import contextlib
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from loadtests import harness
from loadtests.chat_client import Round
from loadtests.harness import summary_ms, table

#: ratio name -> (numerator, denominator): tokens/s of the first over the second, from the phase
#: where both were measured, round for round.
RATIOS = {
    "vllm_vs_vllm_serve": ("artery_vllm", "vllm_serve"),
    "default_vs_best_cpu": ("artery_default", "vllm_cpu_best"),
    "default_vs_vllm_serve_lora": ("artery_default", "vllm_serve_lora"),
    "default_vs_hf_generate": ("artery_default", "hf_generate"),
    "transformers_vs_hf_generate": ("artery_transformers", "hf_generate"),
}
TARGETS = {"vllm_vs_vllm_serve": 0.95, "default_vs_best_cpu": 0.9}
#: What this benchmark writes into inference.json (the inference benchmark keeps them).
KEYS = ("serving", *RATIOS)
#: And what the inference benchmark keeps when it rewrites the file (``--sweep``'s figures too).
KEPT = (*KEYS, "serving_sweep")

#: Contenders whose rounds interleave; the order is the run's.
PHASES: tuple[tuple[str, ...], ...] = (
    ("hf_generate", "artery_transformers"),
    ("artery_vllm", "vllm_serve"),
    ("artery_default", "vllm_serve_lora", "hf_generate"),
    ("artery_default", "vllm_cpu_best"),
)
IN_PROCESS = {"hf_generate"}


# --- pure parts: flags, plans, figures, the result ------------------------------------------


def serve_flags(engine_args: dict) -> tuple[str, ...]:
    """vLLM server flags for the ``AsyncEngineArgs`` an Artery engine builds (``model`` aside):
    ``key=True`` -> ``--key``, ``False`` -> ``--no-key``, ``None`` left out."""
    flags: list[str] = []
    for key, value in engine_args.items():
        if key == "model" or value is None:
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False:
            flags.append("--no-" + flag[2:])
        else:
            flags += [flag, str(value)]
    return tuple(flags)


def stock_vllm_args(engine_args: dict) -> dict:
    """Engine arguments without those naming Artery's own code (a worker extension with its LoRA
    kernels): what ``vllm serve`` alone offers with the same settings, the baseline a LoRA-serving
    path is held to."""
    return {k: v for k, v in engine_args.items() if not (isinstance(v, str) and v.startswith("artery."))}


@dataclass(frozen=True)
class Step:
    """Before phase ``phase``: the servers to start; after it, the ones to stop."""

    phase: tuple[str, ...]
    start: tuple[str, ...]
    stop_after: tuple[str, ...]


def plan(phases: tuple[tuple[str, ...], ...]) -> list[Step]:
    """Each server started before the first phase of a run of phases that need it and stopped
    after the last, so that nothing idle is kept up longer than it must."""
    steps = []
    for i, phase in enumerate(phases):
        servers = [n for n in phase if n not in IN_PROCESS]
        before = phases[i - 1] if i else ()
        after = phases[i + 1] if i + 1 < len(phases) else ()
        steps.append(
            Step(
                phase,
                tuple(n for n in servers if n not in before),
                tuple(n for n in servers if n not in after),
            )
        )
    return steps


def phases_for(ratios: list[str]) -> tuple[tuple[str, ...], ...]:
    """The phases measuring the ratios named (every phase when none is named)."""
    if not ratios:
        return PHASES
    return tuple(p for p in PHASES if any(set(RATIOS[r]) <= set(p) for r in ratios))


def figures(rounds: list[Round], concurrency: int) -> dict:
    """Tokens/s over the timed rounds, and the median round's (which resists a burst of load)."""
    seconds = sum(r.seconds for r in rounds)
    tokens = sum(r.tokens for r in rounds)
    latencies = [s for r in rounds for s in r.latencies]
    return {
        "rounds": len(rounds),
        "requests": concurrency * len(rounds),
        "completion_tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 1),
        "median_round_tokens_per_s": round(statistics.median(r.tokens / r.seconds for r in rounds), 1),
        "request_latency": summary_ms(latencies) if latencies else None,
    }


def assemble(phases: list[dict], contenders: dict[str, dict], config: dict, machine_info: dict) -> dict:
    """The keys written into inference.json: ``serving`` (config, machine, contenders, phases,
    ratios with both sides' figures, targets) and each ratio at the top level. A ratio comes
    from the first phase that measured both sides; one not measured is left out."""
    ratios = {}
    for name, (top, bottom) in RATIOS.items():
        phase = next((p for p in phases if top in p["figures"] and bottom in p["figures"]), None)
        if phase is None:
            continue
        a, b = phase["figures"][top], phase["figures"][bottom]
        ratios[name] = {
            "value": round(a["tokens_per_s"] / b["tokens_per_s"], 3),
            "median_round": round(a["median_round_tokens_per_s"] / b["median_round_tokens_per_s"], 3),
            "phase": phases.index(phase) + 1,
            top: a["tokens_per_s"],
            bottom: b["tokens_per_s"],
        }
    targets = {
        name: {"target": target, "value": ratios[name]["value"], "met": ratios[name]["value"] >= target}
        for name, target in TARGETS.items()
        if name in ratios
    }
    serving = {
        "config": config,
        "machine": machine_info,
        "contenders": contenders,
        "phases": phases,
        "ratios": ratios,
        "targets": targets,
    }
    return {"serving": serving, **{name: r["value"] for name, r in ratios.items()}}


def merge_into(output: Path, measured: dict) -> dict:
    """inference.json with this run's keys replaced (the inference benchmark's kept), written."""
    result: dict = {}
    if output.exists():
        with contextlib.suppress(ValueError):
            result = json.loads(output.read_text())
    result = {k: v for k, v in result.items() if k not in KEYS} | measured
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2) + "\n")
    return result


def idle_waits(phase: dict) -> str:
    """How long the phase's turns waited for the other servers to go idle (``serving.Turns``)."""
    if "idle_wait_s" not in phase:  # a result written before turns waited
        return "turns did not wait for idle servers"
    busy = phase.get("turns_not_idle", 0)
    return f"{phase['idle_wait_s']:.1f} s waiting for idle servers" + (
        f", {busy} turns began with one still busy" if busy else ""
    )


def render(serving: dict) -> str:
    c, m = serving["config"], serving["machine"]
    # CPU s: the server's processes over the whole phase (idle turns included); for what runs in
    # the benchmark's process, that process (the HTTP client of the other turns included).
    rows: list[tuple[str, ...]] = [
        ("phase", "contender", "tokens/s", "median round", "p50 ms", "p99 ms", "CPU s", "what")
    ]
    for i, phase in enumerate(serving["phases"], 1):
        for name, f in phase["figures"].items():
            lat = f["request_latency"]
            rows.append(
                (
                    str(i),
                    name,
                    f"{f['tokens_per_s']:,.1f}",
                    f"{f['median_round_tokens_per_s']:,.1f}",
                    f"{lat['p50']:,.0f}" if lat else "",
                    f"{lat['p99']:,.0f}" if lat else "",
                    f"{phase['cpu_s'].get('benchmark' if name in IN_PROCESS else name, 0.0):.1f}",
                    serving["contenders"][name]["what"],
                )
            )
    ratio_rows: list[tuple[str, ...]] = [("ratio", "tokens/s", "median round", "phase", "target")]
    for name, r in serving["ratios"].items():
        target = serving["targets"].get(name)
        ratio_rows.append(
            (
                name,
                f"{r['value']:.3f}",
                f"{r['median_round']:.3f}",
                str(r["phase"]),
                (f">= {target['target']}: " + ("met" if target["met"] else "BELOW")) if target else "",
            )
        )
    load = [
        f"  phase {i}: load {p['load_average_1m_before']} before; benchmark process "
        f"{p['cpu_s'].get('benchmark', 0.0):.1f} CPU-s; other processes "
        f"{p['cpu_s'].get('other', 0.0):.1f} CPU-s ({p['other_share']:.0%} of the machine) "
        f"over {p['seconds']:.0f} s; {idle_waits(p)}"
        for i, p in enumerate(serving["phases"], 1)
    ]
    return "\n".join(
        [
            f"serving: {c['base_model']}, {c['concurrency']} concurrent chats x {c['rounds']} rounds, "
            f"max_tokens {c['max_tokens']}, temperature 1, logprobs"
            + ("  [--quick: a smoke test, not a measurement]" if c["quick"] else ""),
            f"machine: {m['cpu_count']} CPUs, load {m['load_average_1m_before']} before",
            "",
            *harness.table(rows, right={2, 3, 4, 5, 6}),
            "",
            *table(ratio_rows, right={1, 2, 3}),
            "",
            "while measuring:",
            *load,
        ]
    )
