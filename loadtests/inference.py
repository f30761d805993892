"""Inference benchmark: throughput against plain ``generate``, pause latency, adapter hot-load latency.

What runs: a private nats-server and PostgreSQL under a temporary directory and two inference
replicas (``python -m artery.services.inference``, transformers engine, CPU unless
``ARTERY_INFERENCE_DEVICE`` says otherwise) for one model, started by ``artery.ops.stack.Stack``.

What is measured:

- throughput: rounds of ``--concurrency`` chat requests sent at once to ONE replica through its
  HTTP API (httpx, JSON in and out, ``max_tokens``, temperature 1, distinct prompts), next to the
  same engine class in this process without HTTP (every request submitted in one tick, so one
  batch a round) and Hugging Face ``model.generate`` in this process on the same weights: one
  batched, left-padded call a round with the same prompts (chat template applied), sampling at
  temperature 1 (no top-k, no top-p) with the same ``max_new_tokens``. The replica's figure
  includes HTTP, JSON, the API's validation, the chat template, its scheduler (which batches the
  requests waiting when a batch starts) and the sampled token ids it returns; ``generate``
  includes only the forward passes, sampling and its own bookkeeping. Tokens are the sampled ones
  (up to and including an end-of-sequence token), counted from ``usage`` for the replica and from
  the output otherwise. Rounds of the three run interleaved, after one warm-up round each, so a
  burst of other load hits all three alike; the median round is reported beside the total.
- pause: ``pause_replicas`` / ``resume_replicas`` (the trainer's own calls) over both replicas,
  idle: the call's wall time (reading the live replicas from KV, then the scatter-gather) and the
  scatter-gather alone (request published until every ack is in). Then pauses sent while a
  round of requests is decoding on one replica: those wait for the in-flight requests to finish.
- adapter hot-load: a small LoRA adapter put into the Object Store, then ``checkpoint.published``;
  the clock runs from the publish until ``/v1/models`` of each replica lists ``<model>@<step>``
  (polled every 10 ms): fetch, sha256 check, unpack, load into the engine.

Everything shares the machine's cores (this process, both replicas, nats-server); the CPU seconds
each part used are reported, with what other processes on the machine used meanwhile. torch uses
every core for each forward pass unless ``--threads`` says otherwise (``OMP_NUM_THREADS`` for the
replicas, ``torch.set_num_threads`` here): with a small model on a machine that other work
shares, threads that wait on each other are the first thing to slow down.

Long module: one benchmark, read top to bottom: throughput against two baselines, pause and resume,
adapter loading, then the result and its table. The serving comparison at SmolLM2 scale (vLLM,
``vllm serve``, the default serving path) is ``loadtests/serving.py``; it writes into the same
result file. What every benchmark shares is ``loadtests/harness.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import httpx

from artery.ops.stack import Stack
from artery.schemas import CheckpointPublished, new_event_id
from artery.shared import bus, subjects
from artery.shared.adapters import pack_adapter, put_adapter, sha256_hex
from artery.shared.control_client import live_replicas, pause_replicas, resume_replicas
from artery.shared.models import TINY, resolve_base_model
from artery.shared.settings import CommonSettings
from loadtests import harness, serving
from loadtests.chat_client import Round, chat_round, prompts
from loadtests.harness import (
    STOP_TIMEOUT_S,
    CpuMeter,
    argv_of,
    load_average,
    machine,
    report,
    summary_ms,
    table,
    tail,
)

PROJECT = "bench"
MODEL = "infer"
REPLICAS = ("replica-a", "replica-b")
POLL_S = 0.01
#: Warn when processes outside the benchmark took more than this share of the machine.
OTHER_LOAD_WARNING = 0.1
DEFAULTS = {"rounds": 20, "pause_cycles": 30, "loaded_pauses": 5, "adapter_steps": 5}
QUICK = {"rounds": 1, "pause_cycles": 5, "loaded_pauses": 1, "adapter_steps": 1}


@dataclass
class Config:
    base_model: str
    concurrency: int
    rounds: int
    max_tokens: int
    pause_cycles: int
    loaded_pauses: int
    adapter_steps: int
    threads: int | None
    quick: bool
    output: Path


# --- throughput -----------------------------------------------------------------------------


class InProcessEngine:
    """The replica's engine in this process, without HTTP: every request submitted in one tick."""

    def __init__(self, model_path: str):
        from artery.services.inference.engine.transformers_engine import TransformersEngine

        self.engine = TransformersEngine(model_path)  # the replica's defaults

    async def start(self, config: Config) -> None:
        from artery.services.inference.engine.base import GenerationRequest, SamplingParams

        await self.engine.start()
        params = SamplingParams(max_tokens=config.max_tokens, temperature=1.0)
        template = self.engine.tokenizer.apply_chat_template
        self.requests = [
            GenerationRequest(
                list(template(m, add_generation_prompt=True, return_dict=True)["input_ids"]), params
            )
            for m in prompts(config.concurrency)
        ]

    async def round(self) -> Round:
        started = time.perf_counter()
        results = await asyncio.gather(*(self.engine.generate(r) for r in self.requests))
        return Round(time.perf_counter() - started, sum(len(c[0].token_ids) for c in results), [])

    async def close(self) -> None:
        await self.engine.close()


class HFBaseline:
    """The same weights in this process, generating with ``model.generate`` and nothing around it."""

    def __init__(self, model_path: str, threads: int | None):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # "Loading weights" bars on stderr, in this process only
        if threads:
            torch.set_num_threads(threads)  # this process: the in-process engine and generate()
        self.torch = torch
        self.model_path = model_path
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.tokenizer.padding_side = "left"
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = {eos} if isinstance(eos, int) else set(eos or [self.tokenizer.eos_token_id])
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else min(self.eos_ids)

    def round(self, batch, max_new_tokens: int) -> Round:
        started = time.perf_counter()
        inputs = self.tokenizer.apply_chat_template(
            batch, add_generation_prompt=True, padding=True, return_tensors="pt", return_dict=True
        )
        with self.torch.no_grad():
            out = self.model.generate(
                **inputs,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=max_new_tokens,
                pad_token_id=self.pad_id,
            )
        elapsed = time.perf_counter() - started
        tokens = 0
        for row in out[:, inputs["input_ids"].shape[1] :].tolist():
            tokens += next((i + 1 for i, t in enumerate(row) if t in self.eos_ids), len(row))
        return Round(elapsed, tokens, [])


async def measure_throughput(url: str, baseline: HFBaseline, config: Config, meter: CpuMeter) -> dict:
    """Rounds of the three contenders, interleaved: a burst of other load on the machine hits all
    three alike instead of whichever happened to run then. One warm-up round each is not timed."""
    batch = prompts(config.concurrency)
    engine = InProcessEngine(baseline.model_path)
    limits = httpx.Limits(max_connections=config.concurrency, max_keepalive_connections=config.concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await engine.start(config)
        try:

            async def hf_round() -> Round:  # blocks the loop, which has nothing else to do meanwhile
                return baseline.round(batch, config.max_tokens)

            contenders = {
                "artery_http": lambda: chat_round(client, url, MODEL, batch, config.max_tokens),
                "engine_in_process": engine.round,
                "hf_generate": hf_round,
            }
            rounds: dict[str, list[Round]] = {name: [] for name in contenders}
            cpu: dict[str, dict[str, float]] = {name: {} for name in contenders}
            for contender in contenders.values():
                await contender()  # warm-up
            for _ in range(config.rounds):
                for name, contender in contenders.items():
                    before = meter.snapshot()
                    rounds[name].append(await contender())
                    for part, seconds in CpuMeter.delta(before, meter.snapshot()).items():
                        cpu[name][part] = round(cpu[name].get(part, 0.0) + seconds, 2)
            stats = engine.engine.stats
        finally:
            await engine.close()
    out = {name: throughput(rounds[name], config, cpu[name]) for name in contenders}
    out["artery_http"]["request_latency"] = summary_ms(
        [t for r in rounds["artery_http"] for t in r.latencies]
    )
    # Counted over the warm-up round too: how many batches a round of requests became.
    out["engine_in_process"]["batches_per_round"] = round(stats.batches / (config.rounds + 1), 2)
    out["hf_generate"]["torch_threads"] = baseline.torch.get_num_threads()
    return out


def throughput(rounds: list[Round], config: Config, cpu: dict) -> dict:
    seconds = sum(r.seconds for r in rounds)
    tokens = sum(r.tokens for r in rounds)
    requests = config.concurrency * len(rounds)
    return {
        "rounds": len(rounds),
        "requests": requests,
        "completion_tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 1),
        "requests_per_s": round(requests / seconds, 2),
        # The median round resists a burst of other load better than the total does.
        "median_round_tokens_per_s": round(statistics.median(r.tokens / r.seconds for r in rounds), 1),
        "cpu_s": cpu,
    }


# --- pause / resume -------------------------------------------------------------------------


async def measure_pause(nc, config: Config, url: str) -> dict:
    pause_call, pause_sg, resume_call, resume_sg = [], [], [], []
    for _ in range(config.pause_cycles):
        started = time.perf_counter()
        outcome = await pause_replicas(
            nc, PROJECT, MODEL, lease_seconds=30, requested_by="bench", timeout_s=10
        )
        pause_call.append(time.perf_counter() - started)
        pause_sg.append(outcome.elapsed_s)
        if sorted(outcome.acked) != sorted(REPLICAS):
            raise RuntimeError(f"pause acked by {sorted(outcome.acked)}, expected {REPLICAS}")
        started = time.perf_counter()
        resumed = await resume_replicas(nc, PROJECT, MODEL, outcome.lease_id, requested_by="bench")
        resume_call.append(time.perf_counter() - started)
        resume_sg.append(resumed.elapsed_s)
        if resumed.missing or resumed.still_paused:
            raise RuntimeError(f"resume: missing {resumed.missing}, still paused {resumed.still_paused}")

    # Pauses sent while a round of requests decodes on one replica: the ack waits for them.
    loaded, drained = [], []
    async with httpx.AsyncClient(timeout=600) as client:
        for _ in range(config.loaded_pauses):
            in_flight = asyncio.create_task(
                chat_round(client, url, MODEL, prompts(config.concurrency), config.max_tokens)
            )
            await asyncio.sleep(0.1)
            started = time.perf_counter()
            outcome = await pause_replicas(
                nc, PROJECT, MODEL, lease_seconds=60, requested_by="bench", timeout_s=60
            )
            loaded.append(time.perf_counter() - started)
            drained.append(sum(ack.drained_requests for ack in outcome.acked.values()))
            await resume_replicas(nc, PROJECT, MODEL, outcome.lease_id, requested_by="bench")
            await in_flight
    return {
        "replicas": len(REPLICAS),
        "cycles": config.pause_cycles,
        "pause_call": summary_ms(pause_call),
        "pause_scatter_gather": summary_ms(pause_sg),
        "resume_call": summary_ms(resume_call),
        "resume_scatter_gather": summary_ms(resume_sg),
        "pause_under_load": (
            summary_ms(loaded) | {"requests_sent": config.concurrency, "requests_drained": drained}
            if loaded
            else None
        ),
    }


# --- adapter hot-load -----------------------------------------------------------------------


def make_adapter(model_path: str, dest: Path) -> Path:
    """A small LoRA (r 8 on q_proj and v_proj), saved as safetensors."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():  # transformers 5 deprecations that PEFT still calls
        warnings.simplefilter("ignore", FutureWarning)
        base = AutoModelForCausalLM.from_pretrained(model_path)
        config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
        get_peft_model(base, config).save_pretrained(dest, safe_serialization=True)
    return dest


async def served(client: httpx.AsyncClient, url: str, name: str) -> bool:
    response = await client.get(f"{url}/v1/models")
    return name in {m["id"] for m in response.json()["data"]}


async def measure_adapter_load(js, urls: dict[str, str], config: Config, data: bytes) -> dict:
    put_s, per_replica, everywhere = [], {r: [] for r in urls}, []
    sha = sha256_hex(data)
    async with httpx.AsyncClient(timeout=30) as client:
        for step in range(1, config.adapter_steps + 1):
            object_name = f"{PROJECT}/{MODEL}/{step:04d}"
            started = time.perf_counter()
            await put_adapter(js, object_name, data)
            put_s.append(time.perf_counter() - started)
            name = f"{MODEL}@{step}"
            event = CheckpointPublished(
                id=new_event_id(),
                project=PROJECT,
                model=MODEL,
                step=step,
                object_name=object_name,
                sha256=sha,
                size_bytes=len(data),
                base_model=config.base_model,
                served_name=name,
            )
            published = time.perf_counter()
            await bus.publish_event(js, subjects.checkpoint("published", PROJECT, MODEL), event)
            waiting = dict(urls)
            deadline = published + 120
            while waiting:
                for replica, url in list(waiting.items()):
                    if await served(client, url, name):
                        per_replica[replica].append(time.perf_counter() - published)
                        del waiting[replica]
                if time.perf_counter() > deadline:
                    raise TimeoutError(f"{name} not served by {sorted(waiting)} within 120 s")
                await asyncio.sleep(POLL_S)
            everywhere.append(time.perf_counter() - published)
    return {
        "steps": config.adapter_steps,
        "adapter_bytes": len(data),
        "poll_interval_ms": POLL_S * 1000,
        "object_store_put": summary_ms(put_s),
        "published_to_served": {r: summary_ms(v) for r, v in per_replica.items()},
        "published_to_served_everywhere": summary_ms(everywhere),
        # The first adapter costs more: PEFT wraps the base model's layers once.
        "first_everywhere_ms": round(everywhere[0] * 1000, 2),
        "later_everywhere": summary_ms(everywhere[1:]) if len(everywhere) > 1 else None,
    }


# --- the run --------------------------------------------------------------------------------


def start_replicas(stack: Stack, base_model: str, threads: int | None) -> None:
    # torch reads OMP_NUM_THREADS once, at start-up; unset, it uses every core.
    extra = {"OMP_NUM_THREADS": str(threads)} if threads else {}
    for name in REPLICAS:
        stack.start_service(
            name,
            service="inference",
            env={
                "ARTERY_INFERENCE_PROJECT": PROJECT,
                "ARTERY_INFERENCE_MODEL": MODEL,
                "ARTERY_INFERENCE_BASE_MODEL": base_model,
                "ARTERY_INFERENCE_REPLICA_ID": name,
                "ARTERY_INFERENCE_HEARTBEAT_S": "1",
                **extra,
            },
        )


async def replica_urls(nc, timeout_s: float = 30.0) -> dict[str, str]:
    deadline = time.monotonic() + timeout_s
    while True:
        live = {r.replica_id: r.url for r in await live_replicas(nc.jetstream(), PROJECT, MODEL)}
        if set(REPLICAS) <= live.keys():
            return {name: live[name] for name in REPLICAS}
        if time.monotonic() > deadline:
            raise TimeoutError(f"replicas registered: {sorted(live)}; expected {REPLICAS}")
        await asyncio.sleep(0.1)


async def run(config: Config, stack: Stack, baseline: HFBaseline, adapter: bytes) -> dict:
    load_before = load_average()
    nc = await bus.connect(CommonSettings(nats_url=stack.nats_url), name="bench-inference")
    try:
        await bus.provision(nc.jetstream(), CommonSettings(nats_url=stack.nats_url))
        urls = await replica_urls(nc)
        meter = CpuMeter(stack)
        measured = await measure_throughput(urls[REPLICAS[0]], baseline, config, meter)
        pause = await measure_pause(nc, config, urls[REPLICAS[0]])
        adapters = await measure_adapter_load(nc.jetstream(), urls, config, adapter)
    finally:
        await bus.close(nc)
    return {
        "benchmark": "inference",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": machine(
            load_before,
            device=os.environ.get("ARTERY_INFERENCE_DEVICE", "cpu"),
            torch_threads=config.threads or "default (every core)",
        ),
        "config": {
            "base_model": config.base_model,
            "concurrency": config.concurrency,
            "rounds": config.rounds,
            "max_tokens": config.max_tokens,
            "temperature": 1.0,
            "quick": config.quick,
        },
        "throughput": {
            **measured,
            "ratio_tokens_per_s": _ratio(measured, "artery_http", "tokens_per_s"),
            "ratio_engine_tokens_per_s": _ratio(measured, "engine_in_process", "tokens_per_s"),
            "ratio_median_round": _ratio(measured, "artery_http", "median_round_tokens_per_s"),
            "ratio_engine_median_round": _ratio(measured, "engine_in_process", "median_round_tokens_per_s"),
        },
        "pause": pause,
        "adapter_load": adapters,
    }


def _ratio(measured: dict, name: str, key: str) -> float:
    return round(measured[name][key] / measured["hf_generate"][key], 3)


def _ms(s: dict) -> tuple[str, str, str]:
    return f"{s['p50']:,.1f}", f"{s['p99']:,.1f}", f"{s['max']:,.1f}"


def _load_warning(other: float, seconds: float, cores: int | None, threads: object) -> list[str]:
    share = other / ((cores or 1) * seconds) if seconds else 0.0
    if share <= OTHER_LOAD_WARNING or other < 0.5:
        return []
    return [
        f"WARNING: other processes used {other:.1f} CPU-s ({share:.0%} of the machine) during the timed "
        "rounds: the figures are lower than this machine can do"
        + (
            "; torch threads that wait on each other slow down badly when a core is taken (try --threads 1)."
            if threads != 1
            else "."
        ),
    ]


def render(result: dict) -> str:
    c, m, t, p, a = (result[k] for k in ("config", "machine", "throughput", "pause", "adapter_load"))
    ours, eng, hf = t["artery_http"], t["engine_in_process"], t["hf_generate"]
    includes = {
        "artery_http": "HTTP + JSON, chat template, scheduler, decode, token ids",
        "engine_in_process": f"same engine, no HTTP: {eng['batches_per_round']} batches a round",
        "hf_generate": f"one batched call a round, in-process, {hf['torch_threads']} torch threads",
    }
    labels = {
        "artery_http": "artery, 1 replica, HTTP",
        "engine_in_process": "engine in-process",
        "hf_generate": "HF model.generate",
    }
    rows = [("throughput", "tokens/s", "median round", "requests/s", "tokens", "seconds", "what it includes")]
    for name, label in labels.items():
        f = t[name]
        rows.append(
            (
                label,
                f"{f['tokens_per_s']:,.0f}",
                f"{f['median_round_tokens_per_s']:,.0f}",
                f"{f['requests_per_s']:,.1f}",
                f"{f['completion_tokens']:,}",
                f"{f['seconds']:.2f}",
                includes[name],
            )
        )
    rows += [
        ("artery HTTP / generate", f"{t['ratio_tokens_per_s']:.2f}", f"{t['ratio_median_round']:.2f}"),
        (
            "engine / generate",
            f"{t['ratio_engine_tokens_per_s']:.2f}",
            f"{t['ratio_engine_median_round']:.2f}",
        ),
    ]
    rows = [r + ("",) * (7 - len(r)) for r in rows]
    cpu_lines = [
        f"  {labels[name]}: " + ", ".join(f"{k} {v:.2f}" for k, v in t[name]["cpu_s"].items() if v)
        for name in labels
    ]
    lat = ours["request_latency"]
    latency = [
        ("latency (ms)", "p50", "p99", "max", "note"),
        (
            "request, artery HTTP",
            *_ms(lat),
            f"{c['concurrency']} at once, {c['max_tokens']} tokens; fastest {lat['min']:,.1f} ms",
        ),
        (
            "pause_replicas call",
            *_ms(p["pause_call"]),
            f"{p['replicas']} idle replicas, {p['cycles']} cycles",
        ),
        ("  scatter-gather", *_ms(p["pause_scatter_gather"]), "request published -> every ack in"),
        ("resume_replicas call", *_ms(p["resume_call"]), ""),
        ("  scatter-gather", *_ms(p["resume_scatter_gather"]), ""),
    ]
    if p["pause_under_load"]:
        latency.append(
            (
                "pause, requests in flight",
                *_ms(p["pause_under_load"]),
                f"{p['pause_under_load']['n']} pauses while {c['concurrency']} requests decode",
            )
        )
    latency.append(("adapter object put", *_ms(a["object_store_put"]), f"{a['adapter_bytes']:,} B archive"))
    for replica, s in a["published_to_served"].items():
        latency.append(
            (f"published -> served {replica}", *_ms(s), f"{a['steps']} steps, /v1/models every 10 ms")
        )
    latency.append(
        (
            "published -> served, both",
            *_ms(a["published_to_served_everywhere"]),
            f"first adapter {a['first_everywhere_ms']:,.1f} ms (PEFT wraps the model once)",
        )
    )
    if a["later_everywhere"]:
        latency.append(("  after the first", *_ms(a["later_everywhere"]), ""))
    return "\n".join(
        [
            f"inference: {c['base_model']}, {c['concurrency']} concurrent requests x {c['rounds']} rounds, "
            f"max_tokens {c['max_tokens']}, temperature 1"
            + ("  [--quick: a smoke test, not a measurement]" if c["quick"] else ""),
            f"machine: {m['cpu_count']} CPUs (load {m['load_average_1m_before']} before), "
            f"Python {m['python']}, device {m['device']}, torch threads {m['torch_threads']}",
            "",
            *table(rows, right={1, 2, 3, 4, 5}),
            "",
            "CPU seconds during the timed rounds:",
            *cpu_lines,
            *_load_warning(
                sum(t[n]["cpu_s"].get("other", 0.0) for n in labels),
                sum(t[n]["seconds"] for n in labels),
                m["cpu_count"],
                m["torch_threads"],
            ),
            "",
            *table(latency, right={1, 2, 3}),
        ]
    )


def parse_args(argv: list[str]) -> Config | list[str]:
    parser = harness.parser("inference", __doc__)
    parser.add_argument("--base-model", help=f"weights: a directory or {TINY} (default)")
    parser.add_argument("--concurrency", type=int, help="requests sent at once (and batch size; default 16)")
    parser.add_argument("--rounds", type=int, help=f"timed rounds (default {DEFAULTS['rounds']})")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--pause-cycles", type=int, help=f"default {DEFAULTS['pause_cycles']}")
    parser.add_argument("--loaded-pauses", type=int, help=f"default {DEFAULTS['loaded_pauses']}")
    parser.add_argument("--adapter-steps", type=int, help=f"default {DEFAULTS['adapter_steps']}")
    parser.add_argument(
        "--threads", type=int, help="torch threads of the replicas and of this process (default: torch's)"
    )
    parser.add_argument("--quick", action="store_true", help="a tiny run: a smoke test")
    parser.add_argument(
        "--vllm-vs-serve",
        action="store_true",
        help="only this: `python -m loadtests serving --only vllm_vs_vllm_serve` (Artery's replica on "
        "the vLLM engine against vLLM's own OpenAI server with the same engine arguments), with "
        "--base-model, --concurrency, --rounds, --max-tokens and --output passed on",
    )
    args = parser.parse_args(argv)
    if args.vllm_vs_serve:  # the serving benchmark's arguments
        given = {
            "--base-model": args.base_model,
            "--concurrency": args.concurrency,
            "--rounds": args.rounds,
            "--max-tokens": args.max_tokens,
            "--output": args.output,
        }
        passed = [str(v) for k, v in given.items() if v is not None for v in (k, v)]
        return ["--only", "vllm_vs_vllm_serve", *passed]
    picked = {
        k: getattr(args, k) if getattr(args, k) is not None else (QUICK if args.quick else DEFAULTS)[k]
        for k in DEFAULTS
    }
    if (
        min(
            args.concurrency if args.concurrency is not None else 16,
            args.max_tokens,
            picked["rounds"],
            picked["pause_cycles"],
            picked["adapter_steps"],
        )
        < 1
    ):
        parser.error(
            "--concurrency, --max-tokens, --rounds, --pause-cycles and --adapter-steps must be positive"
        )
    if picked["loaded_pauses"] < 0:
        parser.error("--loaded-pauses must be >= 0")
    return Config(
        base_model=args.base_model or TINY,
        concurrency=args.concurrency or 16,
        max_tokens=args.max_tokens,
        threads=args.threads,
        quick=args.quick,
        output=args.output,
        **picked,
    )


def stop_all(stack: Stack) -> None:
    """SIGTERM to every replica at once, then wait (each drains on its own), then the servers."""
    for process in stack.processes.values():
        process.signal(signal.SIGTERM)
    for process in stack.processes.values():
        process.stop(timeout=STOP_TIMEOUT_S)
    stack.stop()


def main(argv: list[str] | None = None) -> dict:
    config = parse_args(argv_of(argv))
    if isinstance(config, list):
        return serving.main(config)
    with tempfile.TemporaryDirectory(prefix="artery-bench-") as home:
        stack = Stack(home=Path(home), services=())
        try:
            stack.start_infrastructure()
            start_replicas(stack, config.base_model, config.threads)
            # While the replicas load: the baseline model and the adapter, in this process.
            model_path = resolve_base_model(config.base_model)
            baseline = HFBaseline(model_path, config.threads)
            adapter = pack_adapter(make_adapter(model_path, Path(home) / "adapter"))
            for name in REPLICAS:
                stack.processes[name].wait_ready(180)
            result = asyncio.run(run(config, stack, baseline, adapter))
        except BaseException:
            for name in REPLICAS:
                if lines := tail(stack.logs / f"{name}.log", 15):
                    print(f"{name} log (last lines):\n{lines}", file=sys.stderr)
            raise
        finally:
            stop_all(stack)
    if config.output.exists():  # the serving benchmark's figures share the file: keep them
        with contextlib.suppress(ValueError):
            previous = json.loads(config.output.read_text())
            result.update({k: previous[k] for k in serving.KEPT if k in previous})
    return report(result, render, config.output)


if __name__ == "__main__":
    main()
