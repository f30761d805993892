"""One model's GRPO step data-parallel over processes, with ``torch.distributed``.

Every process holds the base model and the same LoRA adapter, trains its shard of each optimizer
step's sequences (every ``world_size``-th one, from its rank) with the loss normalised by the whole
step's sequence and token counts, and the gradients are summed over the processes before the
clip and the optimizer step, which every process then takes alike; rank 0 writes the checkpoint.
The update is the single-process one up to the order of the floating-point sums.

Why a summing ``all_reduce`` of the LoRA gradients rather than DDP: the loss is already divided
by the global counts, so the step's gradient is the plain sum (DDP averages, then the shards would
need rescaling); the gradients accumulate over micro-batches and are needed once per optimizer
step (DDP syncs at every backward unless told not to); and the PEFT model keeps its own surface
(``disable_adapter`` for the KL reference, ``save_pretrained``), which a DDP wrapper hides.

Backend: ``nccl`` on CUDA (each process on ``cuda:<LOCAL_RANK>``), ``gloo`` on CPU. Launched by
``torchrun``; ``launch`` runs one step that way from a ``DistributedStep`` file::

    torchrun --standalone --nproc-per-node 2 -m artery.services.trainer.distributed step.json

``ARTERY_TRAINER_WORLD_SIZE`` is the world size ``launch`` uses when given none, and the trainer
service's: above 1, each GRPO step of the service goes through ``train_over_processes`` (the policy
in memory saved, trained by the processes, rank 0's result loaded back into the same object); SFT
steps stay in the service's process. Every process must run the whole step: a worker stopped alone
between micro-batches would leave the others waiting, so such a step is never cancelled midway (it
finishes or fails as a whole). On CUDA, the processes take ``cuda:0`` to ``cuda:<world_size - 1>``
(``LOCAL_RANK``) whatever device the service names, each with its own copy of the base model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import torch
import torch.distributed as dist
from torch import Tensor

from artery.schemas import TrainConfig, Trajectory
from artery.services.trainer.lora import LoraSettings
from artery.services.trainer.policy import ADAPTER_DIR, TRAINER_STATE, OptimSettings, Policy, StepResult
from artery.services.trainer.sequences import TrainingSequence
from artery.services.trainer.settings import PREFIX, TrainerSettings
from artery.shared.settings import load

RESULT_FILE = "result.json"


class DistributedStep(msgspec.Struct, kw_only=True, frozen=True):
    """One GRPO step to run over processes: the policy to start from, the groups, where to write."""

    base_model: str
    groups: list[list[Trajectory]]
    config: TrainConfig
    max_seq_len: int
    #: Rank 0 saves the policy after the step here (``Policy.save``), with ``result.json``.
    output_dir: str
    #: A checkpoint to restore first (``Policy.save``'s directory); None: a fresh adapter of ``seed``.
    restore_from: str | None = None
    #: The adapter's shape; None: the base model's default (a warm start's own).
    lora: LoraSettings | None = None
    optim: OptimSettings = msgspec.field(default_factory=OptimSettings)
    device: str = "cpu"
    #: torch dtype name (``float32``, ``bfloat16``); None: the policy's default for the device.
    dtype: str | None = None
    seed: int = 0
    temperature: float = 1.0
    #: Asynchronous mode (``Policy.train_step``'s ``off_policy``).
    off_policy: bool = False
    #: The model's chat-template variables, which inference rendered the sampled prompts with.
    chat_template_kwargs: dict[str, Any] = {}
    #: CPU threads per process (0: torch's default).
    torch_threads: int = 0
    #: The passes' precision (``precision``: auto, bfloat16, off).
    autocast: str = "off"


@dataclass(frozen=True)
class ProcessGroupParallel:
    """``step.DataParallel`` over the default process group."""

    rank: int
    world_size: int

    def shard(self, sequences: list[TrainingSequence]) -> list[TrainingSequence]:
        # Strided: a deterministic split whose shards differ by at most one sequence.
        return sequences[self.rank :: self.world_size]

    def sum_gradients(self, params: list[Tensor]) -> None:
        # A shard with no sequence left has no gradient: it still takes part, with zeros.
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])  # one collective per optimizer step
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for param, grad in zip(params, grads, strict=True):
            size = grad.numel()
            param.grad = flat[offset : offset + size].view_as(param).clone()
            offset += size

    def sum_values(self, values: dict[str, float]) -> dict[str, float]:
        keys = sorted(values)
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        tensor = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=device)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return dict(zip(keys, tensor.tolist(), strict=True))


def backend_for(device: str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def run_worker(step: DistributedStep) -> StepResult:
    """This process's part of the step (``RANK``, ``WORLD_SIZE`` etc. set by torchrun)."""
    device = step.device
    if torch.device(device).type == "cuda":
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        torch.cuda.set_device(torch.device(device))
    if step.torch_threads:
        torch.set_num_threads(step.torch_threads)
    dist.init_process_group(backend=backend_for(device))
    try:
        if step.restore_from is not None:
            policy = Policy.restore(
                step.restore_from, step.base_model, step.lora, step.optim, device=device, dtype=step.dtype
            )
        else:
            policy = Policy.create(
                step.base_model, step.lora, step.optim, device=device, dtype=step.dtype, seed=step.seed
            )
        policy.data_parallel = ProcessGroupParallel(dist.get_rank(), dist.get_world_size())
        result = policy.train_step(
            step.groups,
            step.config,
            max_seq_len=step.max_seq_len,
            temperature=step.temperature,
            off_policy=step.off_policy,
            chat_template_kwargs=step.chat_template_kwargs,
            autocast_mode=step.autocast,
        )
        if dist.get_rank() == 0:
            policy.save(step.output_dir)
            Path(step.output_dir, RESULT_FILE).write_bytes(msgspec.json.encode(result))
        dist.barrier()
        return result
    finally:
        dist.destroy_process_group()


def launch(
    step: DistributedStep, world_size: int | None = None, *, spec_path: str | os.PathLike
) -> StepResult:
    """Run ``step`` over ``world_size`` processes (None: ``ARTERY_TRAINER_WORLD_SIZE``) with torchrun
    (this interpreter's); returns the step's result as rank 0 wrote it. Raises ``RuntimeError``
    with the workers' output on failure."""
    if world_size is None:
        world_size = load(TrainerSettings, PREFIX).world_size
    Path(spec_path).write_bytes(msgspec.json.encode(step))
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",  # a local rendezvous on a free port
        "--nnodes=1",
        f"--nproc-per-node={world_size}",
        "-m",
        __name__,
        str(spec_path),
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"distributed step failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return msgspec.json.decode(Path(step.output_dir, RESULT_FILE).read_bytes(), type=StepResult)


def train_over_processes(
    policy: Policy,
    groups: list[list[Trajectory]],
    config: TrainConfig,
    *,
    world_size: int,
    workdir: str | os.PathLike,
    max_seq_len: int,
    temperature: float = 1.0,
    off_policy: bool = False,
    chat_template_kwargs: dict[str, Any] | None = None,
    torch_threads: int = 0,
    autocast: str = "off",
) -> StepResult:
    """``policy.train_step`` over ``world_size`` processes: ``policy`` is saved under ``workdir``
    (an empty directory), every process restores it and trains its shard, and rank 0's adapter,
    optimizer state and step are loaded back into ``policy`` itself (whoever holds it sees the
    trained policy). ``policy`` is left as it was when the step fails (``RuntimeError``).

    Not cancellable: the processes run the whole step. The RNG state stays this process's (the
    step draws none unless LoRA dropout is set, and then each process draws its own)."""
    workdir = Path(workdir)
    start, trained = workdir / "start", workdir / "trained"
    policy.save(start)
    step = DistributedStep(
        base_model=policy.base_model_path,
        groups=groups,
        config=config,
        max_seq_len=max_seq_len,
        output_dir=str(trained),
        restore_from=str(start),
        lora=policy.lora,
        optim=policy.optim,
        device=str(policy.device),
        dtype=str(policy.weights_dtype).removeprefix("torch."),
        seed=policy.seed,
        temperature=temperature,
        off_policy=off_policy,
        chat_template_kwargs=dict(chat_template_kwargs or {}),
        torch_threads=torch_threads,
        autocast=autocast,
    )
    result = launch(step, world_size, spec_path=workdir / "step.json")
    policy.load_adapter_weights(trained / ADAPTER_DIR)
    policy.load_optimizer_state(trained)
    policy.step = int(json.loads((trained / TRAINER_STATE).read_text())["step"])
    return result


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: torchrun ... -m artery.services.trainer.distributed <step.json>", file=sys.stderr)
        return 2
    run_worker(msgspec.json.decode(Path(argv[0]).read_bytes(), type=DistributedStep))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
