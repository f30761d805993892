"""Where a step's files are, on the trainer's disk and in a pulled copy, and what of a backend the
checkpoint transport uses: what both ``artery.s3`` (push, pull, deploy) and
``artery.checkpoint_restore`` (a pulled step made the model's current one) need, so that neither
imports the other's half."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import nats
    from nats.js import JetStreamContext

    from artery.model import Model

#: What makes a pulled step resumable: the trainer's own files (``services/trainer/policy.py``).
TRAINER_FILES = ("trainer_state.json", "optimizer.safetensors", "optimizer.json", "step.json")
OPTIONAL_TRAINER_FILES = ("rng.safetensors",)
#: The trainer's layout (``services/trainer/checkpoints.py``): ``<root>/<project>/<model>/<step:06d>/``.
STEP_FILE, ADAPTER_TAR, ADAPTER_DIR = "step.json", "adapter.tar", "adapter"
TRAINER_SUBDIR = "trainer"


class S3TransportError(RuntimeError):
    """A push or pull that cannot be done as asked; the message says what is missing."""


class CheckpointBackend(Protocol):
    """What the checkpoint transport uses of a backend (``artery.backend.Backend`` has it all).

    It also reads, where present, ``models_path`` or ``path`` (a ``LocalBackend``'s model
    directory) and ``stack`` (its embedded stack, whose trainer's checkpoint directory is on this
    machine); a backend without them is one joined to an Artery elsewhere."""

    async def _connect(self) -> nats.NATS: ...

    async def _js(self) -> JetStreamContext: ...

    async def _get_step(self, model: Model) -> int: ...

    async def _inference_url(self, model: Model, timeout_s: float = 0.0) -> str | None: ...

    async def _wait_until_served(self, model: Model, step: int, timeout_s: float) -> None: ...

    async def register(self, model: Model) -> None: ...


def checkpoint_root(backend: CheckpointBackend, model: Model) -> Path:
    """The trainer's checkpoint directory of ``model`` (needs the trainer on this machine)."""
    stack = getattr(backend, "stack", None)
    if stack is None:
        raise S3TransportError(
            "checkpoints travel from and to the trainer's checkpoint directory, which only a"
            " LocalBackend shares; a Backend joined to an Artery elsewhere cannot reach it"
            " (pass exclude=['checkpoints'] to move the logs only, or use `artery export-model`)"
        )
    root = stack.extra_env.get("ARTERY_TRAINER_CHECKPOINT_DIR") or stack.home / "checkpoints"
    return Path(root) / model.project / model.name
