"""The whole loop on a GPU, through the real services, opt-in: ``ARTERY_TEST_CUDA=1`` and CUDA, else skipped.

``art.LocalBackend`` starts NATS and PostgreSQL (from their wheels; as root, PostgreSQL runs as
its own system user), the collector, reward, publisher and trainer as processes, and one
inference replica for the model, with ``ARTERY_TRAINER_DEVICE=cuda`` and
``ARTERY_INFERENCE_DEVICE=cuda`` (what ``python -m artery.demos.demo --device cuda`` sets). The tiny
model then learns the half-alphabet task as in the demo: rollouts through the replica's
OpenAI-compatible API, ``model.train()`` per step, the trainer pausing the replica (which moves
its model off the GPU and back), the publisher shipping each adapter and the replica hot-loading
it. Checked: the steps advance, the mean reward on seeded held-out samples and on the training
rollouts rises, the trainer ran on ``cuda``, and both the trainer and the replica hold a CUDA
context (``nvidia-smi``, or the ``/dev/nvidia*`` mappings of the process) while the replica serves
the trained steps. Timings go to stdout with ``[gpu-loop]`` (run with -s)::

    ARTERY_TEST_CUDA=1 pytest tests/test_gpu_loop.py -s
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import time
from pathlib import Path

import pytest
import torch

import artery as art
from artery.shared.control_client import live_replicas
from artery.shared.models import TINY
from artery.testing.agents import half_alphabet_rollout

CUDA = os.environ.get("ARTERY_TEST_CUDA") == "1" and torch.cuda.is_available()

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not CUDA, reason="opt-in: set ARTERY_TEST_CUDA=1 on a machine with a CUDA GPU"),
]

#: The demo's tiny preset, with larger groups: on a GPU they cost little and make the curve steadier.
STEPS, GROUPS, GROUP_SIZE, MAX_TOKENS, LEARNING_RATE = 20, 2, 16, 8, 1e-2
#: Seeded held-out samples, the same seeds before and after training.
EVAL_SAMPLES = 48


def report(label: str, value) -> None:
    print(f"[gpu-loop] {label}: {value}", flush=True)


def json_lines(path: Path) -> list[dict]:
    lines = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            lines.append(json.loads(line))
        except ValueError:
            continue
    return lines


def cuda_pids() -> set[int] | None:
    """Processes holding a CUDA context, as nvidia-smi lists them (None: no usable nvidia-smi)."""
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        return None
    return {int(p) for p in out.stdout.split() if p.strip().isdigit()}


def on_gpu(pid: int) -> bool:
    """Whether process ``pid`` opened a CUDA context: nvidia-smi lists it, or it maps the device."""
    pids = cuda_pids()
    if pids and pid in pids:
        return True
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False
    return "/dev/nvidia" in maps


async def evaluate(model: art.TrainableModel, step: int) -> float:
    groups = await art.gather_trajectory_groups(
        [
            art.TrajectoryGroup(
                half_alphabet_rollout(
                    model, max_tokens=MAX_TOKENS, seed=seed, inference_name=model.get_inference_name(step)
                )
                for seed in range(EVAL_SAMPLES)
            )
        ],
        pbar_desc=f"eval @{step}",
    )
    return statistics.fmean(t.reward for t in groups[0])


async def test_the_tiny_model_learns_through_every_service_on_cuda(tmp_path):
    backend = art.LocalBackend(
        path=tmp_path / "artery",
        inference_env={"ARTERY_INFERENCE_DEVICE": "cuda", "ARTERY_INFERENCE_ENGINE": "transformers"},
    )
    backend.stack.extra_env["ARTERY_TRAINER_DEVICE"] = "cuda"
    model = art.TrainableModel(name="alpha", project="gpu", base_model=TINY)
    started = time.monotonic()
    try:
        await model.register(backend)
        report("stack up (NATS, PostgreSQL, 4 services, CUDA replica)", f"{time.monotonic() - started:.1f}s")
        before = await evaluate(model, 0)
        curve: list[float] = []
        step_times: list[float] = []
        trainer_times: list[float] = []
        paused: list[float] = []
        for expected in range(1, STEPS + 1):
            groups = await art.gather_trajectory_groups(
                (
                    art.TrajectoryGroup(
                        half_alphabet_rollout(model, max_tokens=MAX_TOKENS) for _ in range(GROUP_SIZE)
                    )
                    for _ in range(GROUPS)
                ),
                pbar_desc=f"step {expected - 1} rollouts",
            )
            curve.append(statistics.fmean(t.reward for g in groups for t in g))
            t0 = time.monotonic()
            result = await model.train(groups, config=art.TrainConfig(learning_rate=LEARNING_RATE))
            step_times.append(time.monotonic() - t0)
            trainer_times.append(result.metrics.get("step_total_s", float("nan")))
            paused.append(result.metrics.get("replicas_paused", 0.0))
            assert result.step == expected
            print(
                f"[gpu-loop] step {result.step:>2}: reward {curve[-1]:.3f} loss {result.metrics.get('loss')}"
                f" train() {step_times[-1]:.2f}s (trainer {trainer_times[-1]:.2f}s)",
                flush=True,
            )
        steps = await model.get_step()
        assert steps == STEPS
        after = await evaluate(model, steps)

        # Where it ran: the trainer on cuda, and both processes hold a CUDA context right now.
        trainer = backend.stack.processes["trainer"]
        ready = [e for e in json_lines(trainer.log_path) if e.get("event") == "ready"]
        assert ready and ready[-1].get("device") == "cuda", ready
        replica_name = f"inference-{model.project}-{model.name}"
        replica = backend.stack.processes[replica_name]
        assert replica.running and trainer.running
        assert on_gpu(trainer.proc.pid), "the trainer holds no CUDA context"
        assert on_gpu(replica.proc.pid), "the inference replica holds no CUDA context"
        # The replica serves every trained step (hot-loaded adapters) and was paused for each step.
        replicas = await live_replicas(await backend._js(), model.project, model.name)
        assert len(replicas) == 1 and replicas[0].engine == "transformers"
        served = set(replicas[0].served)
        assert f"{model.name}@{steps}" in served, served
        loaded = [e for e in json_lines(replica.log_path) if e.get("event") == "adapter loaded"]
        assert len(loaded) >= 1
        assert all(p == 1.0 for p in paused), paused

        first, last = statistics.fmean(curve[:3]), statistics.fmean(curve[-3:])
        report("device", torch.cuda.get_device_name())
        report("reward curve", [round(r, 2) for r in curve])
        report("training rollouts, mean of first/last 3 steps", f"{first:.3f} -> {last:.3f}")
        report("held-out seeded samples, mean reward", f"{before:.3f} -> {after:.3f}")
        report("train() per step, median", f"{statistics.median(step_times):.2f}s")
        report("trainer step_total_s, median", f"{statistics.median(trainer_times):.2f}s")
        report("adapters loaded by the replica", len(loaded))
        report("wall time", f"{time.monotonic() - started:.1f}s")
        assert after > before, (before, after)
        assert last > first, curve
    finally:
        await backend.close()
