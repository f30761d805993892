"""Trainer memory: the resident memory of GRPO steps on SmolLM2-135M on the CPU, and where it goes.

What runs, per scenario in a fresh process (``ru_maxrss`` only ever grows): ``Policy.create`` on
SmolLM2-135M-Instruct with the trainer service's settings (LoRA r8/alpha 16 on q/k/v/o/gate/up/down
and ``lm_head``, micro-batches of 8, ``max_seq_len`` 2048, temperature 1), then ``train_step`` on
groups shaped as ``make demo``'s: 2 groups x 8 rollouts of the lowercase-sentence task (its real
prompt, worked example included, through the chat template) with 20-token answers (the demo's
``max_tokens``, the longest it samples) and unequal rewards, so that every sequence trains. The
answers are a fixed text and their sampler logprobs a constant: memory does not depend on either.

The trainer service runs each step with ``asyncio.to_thread``, then saves and packs the checkpoint
the same way; with calls made one after another like that, asyncio's default executor runs
consecutive steps on two threads in turn (checked with a stand-in for the three calls). The steps
here alternate between two worker threads likewise: glibc gives each thread its own malloc arena.

Reported per scenario:

- RSS (``/proc/self/statm``; anonymous and file-backed from ``/proc/self/status``) and peak RSS
  (``getrusage``) after importing torch, after ``Policy.create``, and after reading every weight
  once (the baseline: safetensors are mapped, and count as resident once read);
- per step: its wall time, the process's CPU time (user, system) and minor page faults, RSS and
  peak RSS after it, and glibc's own account (``mallinfo2``, every arena): heap in use, and heap
  free (what a step freed and the allocator kept; resident unless ``malloc_trim`` released it);
- torch's view: the parameters (distinct storages: the tied embedding counts once), the adapter,
  AdamW's state, and the bytes autograd saved for backward in the first step's largest micro-batch,
  split into the decoder (``body``), ``lm_head`` (with its LoRA) and what follows (``logprobs``:
  logprobs and loss); parameters that autograd saves are not counted (they are resident anyway).

Scenarios: ``service`` (as above, with the ``malloc_trim`` that a trainer makes once idle made
after every step, as for a trainer idle between its steps); ``glibc_defaults`` (the same without
the trim: glibc raises its mmap threshold as blocks are freed,
serves the activations from its arenas and keeps them); ``mmap_threshold_128k``
(``MALLOC_MMAP_THRESHOLD_=131072`` in the environment: every block of 128 KiB or more is mapped on
its own and unmapped when freed, so that the arenas never hold activations, at the price of a page
fault per page each time); ``micro_batch_4`` (micro-batches of 4, the trainer's ``micro_batch_size``
setting); ``activation_checkpointing`` (transformers' gradient checkpointing on the decoder layers,
recomputed in backward: not something the trainer does, a measure of the decoder's share).

Long module: one benchmark, read top to bottom: the memory probes, the scenarios (each in a child
process), the result and its table. What every benchmark shares is ``loadtests/harness.py``.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import datetime as dt
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from loadtests import harness
from loadtests.harness import argv_of, load_average, machine, report, table

MIB = 1 << 20
#: What the demo's rollouts look like: prompts, answer length and rewards per group.
GROUPS = 2
GROUP_SIZE = 8
ANSWER_TOKENS = 20
ANSWER_TEXT = "a small brown cat sleeps on the warm windowsill while the rain falls outside the old house"
SAMPLER_LOGPROB = -2.0
LEARNING_RATE = 3e-4
#: The trainer service's defaults (``services/trainer/settings.py``).
MAX_SEQ_LEN = 2048
MICRO_BATCH_SIZE = 8
WORKER_THREADS = 2
#: Scenario -> environment of its process, on top of ours.
SCENARIOS: dict[str, dict[str, str]] = {
    "service": {},
    "glibc_defaults": {},
    "mmap_threshold_128k": {"MALLOC_MMAP_THRESHOLD_": str(128 << 10)},
    "micro_batch_4": {},
    "activation_checkpointing": {},
}


@dataclass(frozen=True, kw_only=True)
class Config:
    steps: int
    scenarios: tuple[str, ...]
    threads: int
    quick: bool
    output: Path


# --------------------------------------------------------------------------- process memory


def rss_mib() -> float:
    """Resident set size now (``/proc/self/statm``)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MIB


def peak_rss_mib() -> float:
    """The largest RSS so far (Linux reports ``ru_maxrss`` in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_kinds_mib() -> dict[str, float]:
    """Anonymous (heap: activations, allocator caches) and file-backed (mapped weights, libraries)."""
    kinds = {}
    with open("/proc/self/status") as status:
        for line in status:
            name, _, value = line.partition(":")
            if name in ("RssAnon", "RssFile"):
                kinds[name] = int(value.split()[0]) / 1024
    return {"anon_mib": round(kinds["RssAnon"], 1), "file_mib": round(kinds["RssFile"], 1)}


class MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (glibc 2.33+): byte counts summed over every arena."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",  # heap obtained with brk/sbrk and arena heaps
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",  # bytes in blocks mapped on their own (mmap)
            "usmblks",
            "fsmblks",
            "uordblks",  # heap in use
            "fordblks",  # heap free, kept by the allocator
            "keepcost",
        )
    ]


def malloc_heap_mib() -> dict[str, float]:
    """glibc's view of its heap (empty where there is no ``mallinfo2``)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    if not hasattr(libc, "mallinfo2"):
        return {}
    libc.mallinfo2.restype = MallInfo2
    info = libc.mallinfo2()
    return {
        "heap_in_use_mib": round(info.uordblks / MIB, 1),
        "heap_free_kept_mib": round(info.fordblks / MIB, 1),
        "mapped_blocks_mib": round(info.hblkhd / MIB, 1),
    }


def snapshot() -> dict[str, float]:
    return {
        "rss_mib": round(rss_mib(), 1),
        "peak_rss_mib": round(peak_rss_mib(), 1),
        **rss_kinds_mib(),
        **malloc_heap_mib(),
    }


# --------------------------------------------------------------------------- torch's view


def storage_mib(tensors: Iterator[Any]) -> float:
    """Bytes of the distinct storages behind ``tensors`` (tied weights count once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return round(sum(storages.values()) / MIB, 1)


class SavedForBackward:
    """The bytes autograd saves for backward per micro-batch, by the part of the model that saved
    them. Forward hooks mark the parts: the policy's forward starts a micro-batch in ``body``, the
    output embedding (``lm_head``) switches to ``lm_head``, its output to ``logprobs``."""

    PARTS = ("body", "lm_head", "logprobs")

    def __init__(self, model: Any) -> None:
        self.parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.part = "body"
        self.storages: dict[int, tuple[str, int]] = {}
        self.largest: dict[str, float] = {}
        head = model.get_output_embeddings()
        self.handles = [
            model.register_forward_pre_hook(lambda *_: self._start_micro_batch()),
            head.register_forward_pre_hook(lambda *_: self._enter("lm_head")),
            head.register_forward_hook(lambda *_: self._enter("logprobs")),
        ]

    def _enter(self, part: str) -> None:
        self.part = part

    def _start_micro_batch(self) -> None:
        import torch

        if torch.is_grad_enabled():  # the KL reference forward saves nothing
            self._close_micro_batch()
            self.part = "body"

    def _close_micro_batch(self) -> None:
        totals = {part: 0.0 for part in self.PARTS}
        for part, nbytes in self.storages.values():
            totals[part] += nbytes / MIB
        if sum(totals.values()) > sum(self.largest.values()):
            self.largest = {part: round(mib, 1) for part, mib in totals.items()}
        self.storages = {}

    def pack(self, tensor: Any) -> Any:
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer not in self.parameters and pointer not in self.storages:
            self.storages[pointer] = (self.part, storage.nbytes())
        return tensor

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Saved-tensor hooks are per thread: enter this in the thread that runs the step."""
        import torch

        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda tensor: tensor):
                yield
            self._close_micro_batch()
        finally:
            for handle in self.handles:
                handle.remove()


# --------------------------------------------------------------------------- one scenario


def demo_groups(tokenizer: Any) -> list[list[Any]]:
    """``GROUPS`` groups of ``GROUP_SIZE`` lowercase-task rollouts with ``ANSWER_TOKENS``-token
    answers (the stop token included), rewards spread over [0, 1] within each group."""
    from artery.schemas import Message, Sample, Trajectory
    from artery.testing.tasks import SUBJECTS_TRAIN, lowercase_task_prompt

    words = tokenizer.encode(ANSWER_TEXT, add_special_tokens=False)
    answer = [*words[: ANSWER_TOKENS - 1], tokenizer.eos_token_id]
    sample = Sample(token_ids=answer, logprobs=[SAMPLER_LOGPROB] * len(answer), finish_reason="stop")
    reply = Message(role="assistant", content=tokenizer.decode(answer[:-1]), sample=sample)

    def rollout(subject: str, reward: float) -> Trajectory:
        prompt = [Message(role=m["role"], content=m["content"]) for m in lowercase_task_prompt(subject)]
        return Trajectory(messages=[*prompt, reply], reward=reward)

    return [
        [rollout(SUBJECTS_TRAIN[g], i / (GROUP_SIZE - 1)) for i in range(GROUP_SIZE)] for g in range(GROUPS)
    ]


def read_every_weight(model: Any) -> None:
    """Touch every parameter page, so that mapped weights are resident before the baseline."""
    import torch

    with torch.no_grad():
        for parameter in model.parameters():
            parameter.sum()


class ReleasedByEachStep:
    """The freed heap as these scenarios keep it: ``measure_scenario`` releases it after each step
    (where the scenario says so), so the policy's own idle release has nothing to do here."""

    @contextmanager
    def step(self) -> Iterator[None]:
        yield


def scenario_policy(name: str) -> Any:
    from artery.services.trainer import policy as policy_module
    from artery.services.trainer.policy import LoraSettings, OptimSettings, Policy
    from artery.shared.models import SMOLLM2

    # This process only (it runs nothing else): the steps here release the heap themselves
    # (``measure_scenario``), at once, rather than after the trainer's idle time.
    policy_module.freed_heap = ReleasedByEachStep()
    micro_batch_size = 4 if name == "micro_batch_4" else MICRO_BATCH_SIZE
    policy = Policy.create(SMOLLM2, LoraSettings(), OptimSettings(micro_batch_size=micro_batch_size))
    if name == "activation_checkpointing":
        policy.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return policy


def timed(call: Callable[[], Any]) -> tuple[Any, dict[str, float]]:
    """``call()``, with its wall time, the CPU time of the whole process (every thread: user and
    system, where mapping and zeroing pages shows) and its minor page faults."""
    before, started = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    result = call()
    seconds, after = time.perf_counter() - started, resource.getrusage(resource.RUSAGE_SELF)
    return result, {
        "seconds": round(seconds, 2),
        "user_s": round(after.ru_utime - before.ru_utime, 2),
        "system_s": round(after.ru_stime - before.ru_stime, 2),
        "minor_faults": after.ru_minflt - before.ru_minflt,
    }


def measure_scenario(name: str, steps: int, threads: int) -> dict[str, Any]:
    """One scenario, in this (fresh) process."""
    import torch
    import transformers

    from artery.schemas import TrainConfig
    from artery.services.trainer.memory import release_freed_memory

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    if threads:
        torch.set_num_threads(threads)
    imported = snapshot()
    policy, load = timed(lambda: scenario_policy(name))
    created = snapshot()
    read_every_weight(policy.model)
    baseline = snapshot()
    groups = demo_groups(policy.tokenizer)
    config = TrainConfig(learning_rate=LEARNING_RATE)
    saved = SavedForBackward(policy.model)

    def step() -> Any:
        result = policy.train_step(groups, config, max_seq_len=MAX_SEQ_LEN)
        if name != "glibc_defaults":
            release_freed_memory()
        return result

    def first_step() -> Any:
        with saved.recording():
            return step()

    workers = [ThreadPoolExecutor(max_workers=1) for _ in range(WORKER_THREADS)]
    rows = []
    try:
        for index in range(steps):
            work = first_step if index == 0 else step
            result, cost = timed(workers[index % WORKER_THREADS].submit(work).result)
            rows.append(
                {
                    "step": index + 1,
                    "worker_thread": index % WORKER_THREADS,
                    **cost,
                    "trained": result.trained,
                    "sequences": result.metrics["sequences"],
                    **snapshot(),
                }
            )
            print(f"  {name} step {index + 1}: {rows[-1]}", file=sys.stderr, flush=True)
    finally:
        for worker in workers:
            worker.shutdown()
    model = policy.model
    return {
        "scenario": name,
        "load_s": load["seconds"],
        "after_import": imported,
        "after_create": created,
        "baseline": baseline,
        "steps": rows,
        "torch": {
            "parameters_mib": storage_mib(model.parameters()),
            "adapter_mib": storage_mib(p for _, p in policy.named_trainable),
            "optimizer_state_mib": storage_mib(
                v for s in policy.optimizer.state.values() for v in s.values() if torch.is_tensor(v)
            ),
            "saved_for_backward_mib": saved.largest,
            "torch_threads": torch.get_num_threads(),
        },
    }


def run_scenario(name: str, config: Config) -> dict[str, Any]:
    """``measure_scenario`` in a child process, whose result comes back as a JSON file."""
    print(f"scenario {name}: {config.steps} step(s) in a fresh process...", flush=True)
    with tempfile.TemporaryDirectory(prefix="artery-trainer-memory-") as scratch:
        result_file = Path(scratch) / "result.json"
        command = [sys.executable, "-m", "loadtests.trainer_memory", "--child", name]
        command += ["--steps", str(config.steps), "--threads", str(config.threads)]
        command += ["--child-output", str(result_file)]
        environment = {**os.environ, **SCENARIOS[name]}
        subprocess.run(command, check=True, cwd=Path(__file__).resolve().parent.parent, env=environment)
        return json.loads(result_file.read_text())


# --------------------------------------------------------------------------- the run


def run(config: Config) -> dict[str, Any]:
    import peft
    import torch
    import transformers

    load_before = load_average()
    scenarios = {name: run_scenario(name, config) for name in config.scenarios}
    summary = {name: summarize(result) for name, result in scenarios.items()}
    return {
        "benchmark": "trainer_memory",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": machine(
            load_before,
            device="cpu",
            torch_threads=config.threads or torch.get_num_threads(),
            torch=torch.__version__,
            transformers=transformers.__version__,
            peft=peft.__version__,
        ),
        "config": {
            **{k: v for k, v in asdict(config).items() if k != "output"},
            "model": "SmolLM2-135M-Instruct",
            "groups": GROUPS,
            "group_size": GROUP_SIZE,
            "answer_tokens": ANSWER_TOKENS,
            "max_seq_len": MAX_SEQ_LEN,
            "micro_batch_size": MICRO_BATCH_SIZE,
            "worker_threads": WORKER_THREADS,
            "lora": {"rank": 8, "alpha": 16, "target_modules": "q/k/v/o/gate/up/down + lm_head"},
        },
        "summary": summary,
        "scenarios": scenarios,
    }


def summarize(result: dict[str, Any]) -> dict[str, float]:
    """The figures of the table: all in MiB, over the baseline after loading."""
    baseline = result["baseline"]["rss_mib"]
    steps = result["steps"]
    return {
        "baseline_rss_mib": baseline,
        "peak_over_baseline_mib": round(steps[-1]["peak_rss_mib"] - baseline, 1),
        "first_step_peak_over_baseline_mib": round(steps[0]["peak_rss_mib"] - baseline, 1),
        "held_after_last_step_mib": round(steps[-1]["rss_mib"] - baseline, 1),
        "heap_free_kept_mib": steps[-1].get("heap_free_kept_mib", float("nan")),
        "median_step_s": median([s["seconds"] for s in steps]),
        "median_cpu_s": median([s["user_s"] + s["system_s"] for s in steps]),
        "median_system_s": median([s["system_s"] for s in steps]),
    }


def median(values: list[float]) -> float:
    return round(statistics.median(values), 2)


def render(result: dict[str, Any]) -> str:
    c, m = result["config"], result["machine"]
    figures = [
        (
            "scenario",
            "baseline",
            "peak, step 1",
            "peak, all",
            "held after",
            "arena free",
            "saved: body",
            "lm_head",
            "logprobs",
            "step s",
            "cpu s",
            "system s",
        )
    ]
    for name, s in result["summary"].items():
        saved = result["scenarios"][name]["torch"]["saved_for_backward_mib"]
        figures.append(
            (
                name,
                f"{s['baseline_rss_mib']:.0f}",
                f"+{s['first_step_peak_over_baseline_mib']:.0f}",
                f"+{s['peak_over_baseline_mib']:.0f}",
                f"+{s['held_after_last_step_mib']:.0f}",
                f"{s['heap_free_kept_mib']:.0f}",
                *(f"{saved.get(part, 0.0):.0f}" for part in SavedForBackward.PARTS),
                f"{s['median_step_s']:.1f}",
                f"{s['median_cpu_s']:.1f}",
                f"{s['median_system_s']:.1f}",
            )
        )
    first = next(iter(result["scenarios"].values()))
    torch_view = first["torch"]
    return "\n".join(
        [
            f"trainer memory: {c['model']} on the CPU, {c['groups']} groups x {c['group_size']} rollouts "
            f"of <= {c['answer_tokens']} answer tokens, micro-batches of {c['micro_batch_size']}, "
            f"LoRA r8 on {c['lora']['target_modules']}, steps alternating between "
            f"{c['worker_threads']} worker threads" + ("  [--quick: a smoke test]" if c["quick"] else ""),
            f"machine: {m['cpu_count']} CPUs (load {m['load_average_1m_before']} before), "
            f"{m['torch_threads']} torch thread(s); torch {m['torch']}, transformers {m['transformers']}, "
            f"peft {m['peft']}",
            f"{c['steps']} step(s) per scenario, each scenario in a fresh process. MiB; RSS over the "
            "baseline (after loading and reading every weight); 'held after' and 'arena free' "
            "(glibc's mallinfo2: free blocks, resident unless trimmed) after the last step; "
            "'saved': autograd's saved tensors, largest micro-batch of step 1; step, CPU (all "
            "threads) and system seconds: medians",
            f"torch: parameters {torch_view['parameters_mib']:.0f} MiB, adapter "
            f"{torch_view['adapter_mib']:.1f} MiB, AdamW state {torch_view['optimizer_state_mib']:.1f} "
            f"MiB; RSS after import {first['after_import']['rss_mib']:.0f}, after Policy.create "
            f"{first['after_create']['rss_mib']:.0f}",
            "",
            *table(figures, right=set(range(1, len(figures[0])))),
        ]
    )


def parse_args(argv: list[str]) -> tuple[Config, argparse.Namespace]:
    parser = harness.parser("trainer_memory", __doc__)
    parser.add_argument("--steps", type=int, help="training steps per scenario (default 3; quick 1)")
    parser.add_argument(
        "--scenarios",
        nargs="+",
        choices=SCENARIOS,
        help=f"which to run (default all: {', '.join(SCENARIOS)}; quick: service)",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default 0: torch's own)")
    parser.add_argument("--quick", action="store_true", help="one step of one scenario: a smoke test")
    parser.add_argument("--child", choices=SCENARIOS, help=argparse.SUPPRESS)
    parser.add_argument("--child-output", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    steps = args.steps or (1 if args.quick else 3)
    if steps < 1 or args.threads < 0:
        parser.error("--steps must be positive, --threads >= 0")
    scenarios = tuple(args.scenarios or (("service",) if args.quick else SCENARIOS))
    config = Config(
        steps=steps, scenarios=scenarios, threads=args.threads, quick=args.quick, output=args.output
    )
    return config, args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    config, args = parse_args(argv_of(argv))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT's and transformers' advice
        if args.child:
            result = measure_scenario(args.child, config.steps, config.threads)
            args.child_output.write_text(json.dumps(result))
            return result
        result = run(config)
    return report(result, render, config.output)


if __name__ == "__main__":
    main()
