"""``LocalBackend``: the embedded stack (NATS, PostgreSQL, every service) started as child
processes, and a ``Backend`` connected to it. ``art.local.backend.LocalBackend`` is ART's module
path for it; ``artery.LocalBackend`` is the same class."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import nats

from artery.backend import Backend
from artery.checkpoint_layout import checkpoint_root
from artery.dev import note_no_effect
from artery.errors import LocalServingUnavailableError
from artery.local.train_result import LocalTrainResult
from artery.ops.stack import SERVICES, Stack
from artery.ops.stack_engine import EngineChoice, replica_engine
from artery.schemas.training import TrainConfig
from artery.shared import lifeline
from artery.shared.auth import nats_connect_options, secret_value
from artery.shared.embedded import free_port

if TYPE_CHECKING:
    from artery.model import Model


class LocalBackend(Backend):
    """Starts the embedded stack under ``path`` (default ``./.artery``) and connects to it.

    The stack lives as long as the program: ``close()`` stops it, and so does the program's end
    without it (normal, by an exception or a signal; ``shared.lifeline``). ``artery up`` is the way
    to keep a stack running on purpose.

    ``secure=True``: every service runs as its own NATS user (``Stack(secure=True)``) and the
    backend connects as ``agent-<project>``, so it may use ``project``'s subjects only.

    ``engine``: the inference engine of the replicas it starts. None (or "auto", or no
    ``ARTERY_INFERENCE_ENGINE`` anywhere) picks the fastest one that can serve the model here
    (``artery.ops.stack_engine``): vLLM-CPU in bfloat16 when ``.venv-vllm`` is built, the CPU has
    bf16 instructions and the model qualifies, else the transformers engine; one line on stderr
    says which and why. When the replica samples in another dtype than the trainer trains in,
    ``train()`` corrects for it with truncated importance sampling unless the config sets its
    own cap.
    """

    def __init__(
        self,
        *,
        in_process: bool = False,
        path: str | os.PathLike | None = None,
        gpu_cost_per_hour_usd: float | None = None,
        services: tuple[str, ...] | None = None,
        start_inference: bool = True,
        inference_env: dict[str, str] | None = None,
        secure: bool = False,
        project: str | None = None,
        engine: str | None = None,
    ):
        super().__init__(nats_url="nats://127.0.0.1:0")
        if in_process:
            # ART's in_process=True runs its trainer inside the caller (for notebooks' output);
            # Artery's services are always their own processes (that is what lets each restart,
            # scale and be traced alone), so the flag changes nothing: said once, not refused.
            note_no_effect(
                "LocalBackend(in_process=True)",
                "Artery's services always run as their own processes (their logs: `artery logs`)",
            )
        #: ART's figure for cost metrics; kept for scripts that pass it (no GPU is priced on a CPU).
        self.gpu_cost_per_hour_usd = gpu_cost_per_hour_usd
        #: Where model files go (``<project>/models/<name>/``): ART's ``.art`` unless a path is given.
        self.models_path = Path(".art" if path is None else path)
        path = ".artery" if path is None else path
        if secure != (project is not None):
            raise ValueError("secure=True needs the project whose agent user the backend connects as")
        self.path = Path(path)
        self.project = project
        self.stack = Stack(
            home=self.path / "stack",
            services=services or SERVICES,
            secure=secure,
            projects=(project,) if project is not None else (),
        )
        # Secure (a project is given with it, checked above): its replicas serve requests that
        # carry its project's key, and no other.
        if project is not None:
            key_file = str(self.stack.inference_key_file(project))
            self.inference_api_key = secret_value(None, key_file, "ARTERY_INFERENCE_API_KEY")
        #: Extra ``ARTERY_INFERENCE_*`` settings for the replicas it starts (engine, device...).
        self.inference_env = dict(inference_env or {})
        if engine not in (None, "auto"):  # "vllm": replicas run from .venv-vllm (make setup-vllm)
            self.inference_env["ARTERY_INFERENCE_ENGINE"] = engine
        self.start_inference = start_inference
        #: Each started replica's engine choice, by ``(project, name)``.
        self.engines: dict[tuple[str, str], EngineChoice] = {}
        self._started = False

    async def _connect(self) -> nats.NATS:
        if not self._started:
            # Armed before the start, from this (usually the main) thread, where signal handlers
            # can be set: a program that ends while the stack starts stops what had started.
            self._exit_hook = lifeline.at_exit(self.stack.stop)
            # The stack's start below leaves an idle executor thread: a signal the kernel hands
            # to it must still wake this loop, or its handler (Ctrl-C's) never runs.
            lifeline.wake_loop_on_signals(asyncio.get_running_loop())
            # Starting servers blocks for about a second: keep the event loop free meanwhile.
            await asyncio.to_thread(self.stack.start)
            if self.stack.console_url:  # where to watch the run: said once, like ART's W&B link
                print(f"Artery console: {self.stack.console_url}", file=sys.stderr, flush=True)
            self.settings = msgspec.structs.replace(self.settings, nats_url=self.stack.nats_url)
            if self.project is not None:
                self._nats_options = nats_connect_options(self.settings, self.stack.agent_env(self.project))
            self._started = True
        return await super()._connect()

    async def _inference_url(self, model: Model, timeout_s: float | None = None) -> str | None:
        """Start this model's inference replica (once), then find it in the registry; ``timeout_s``
        (default: the engine's ``start_timeout_s``) for each. Without ``start_inference`` the
        replica is someone else's: it is registered already or not at all."""
        if not self.start_inference:
            return await super()._inference_url(model, timeout_s=0.0)
        name = f"inference-{model.project}-{model.name}"
        if name not in self.stack.processes:
            await self._start_replica(name, model, timeout_s)
        if timeout_s is None:
            timeout_s = self.engines[(model.project, model.name)].start_timeout_s
        return await super()._inference_url(model, timeout_s=timeout_s)

    async def _start_replica(self, name: str, model: Model, timeout_s: float | None) -> None:
        """Start replica ``name`` for ``model`` on the engine chosen for it and wait until it says
        ready: ``timeout_s``, else the engine's ``start_timeout_s``."""
        base_model = getattr(model, "base_model", None)
        if not isinstance(base_model, str):
            raise TypeError(f"{model!r} names no base model: a replica serves a TrainableModel's")
        choice = replica_engine(base_model, {**os.environ, **self.stack.extra_env, **self.inference_env})
        print(f"{name}: {choice.log_line()}", file=sys.stderr, flush=True)
        self.engines[(model.project, model.name)] = choice
        env = {
            **self.stack.replica_env(model.project, model.name, base_model),
            "ARTERY_INFERENCE_REPLICA_ID": f"local-{model.project}-{model.name}",
            # A fixed port: a replica restarted after a crash comes back where clients look.
            "ARTERY_INFERENCE_PORT": str(free_port()),
            **self.inference_env,
            **choice.env,
        }
        process = self.stack.start_service(name, service="inference", env=env)
        ready_within = choice.start_timeout_s if timeout_s is None else timeout_s
        try:
            await asyncio.to_thread(process.wait_ready, ready_within)
        except (RuntimeError, TimeoutError) as exc:  # as ART: local serving cannot start
            raise LocalServingUnavailableError(f"{name} did not start serving: {exc}") from exc

    async def train(self, model: Model, *args: Any, **kwargs: Any) -> LocalTrainResult:
        """``Backend.train``, returning ART's ``LocalTrainResult`` (with the step's checkpoint path).

        Samples from a replica in another dtype than the trainer's (vLLM-CPU's bf16 against the
        float32 trainer) are trained with truncated importance sampling at the choice's cap,
        unless the caller gave a cap of its own."""
        choice = self.engines.get((model.project, model.name))
        if choice is not None and choice.tis_cap is not None:
            if len(args) > 1:  # train(model, groups, config): the config given in its place
                args = (args[0], with_tis_cap(args[1], kwargs, choice.tis_cap), *args[2:])
            else:
                kwargs["config"] = with_tis_cap(kwargs.get("config"), kwargs, choice.tis_cap)
        result = await super().train(model, *args, **kwargs)
        return LocalTrainResult.at(result, checkpoint_root(self, model) / f"{result.step:06d}")

    @property
    def database_url(self) -> str | None:
        return self.stack.database_url

    async def close(self) -> None:
        await super().close()
        if self._started:
            await asyncio.to_thread(self.stack.stop)
            lifeline.cancel(self._exit_hook)
            self._started = False


def with_tis_cap(config: TrainConfig | None, fields: dict[str, Any], cap: float) -> TrainConfig:
    """``config`` with truncated importance sampling at ``cap``, unless a cap was given already
    (in the config or as the ``truncated_importance_sampling=`` keyword)."""
    config = config or TrainConfig()
    if config.truncated_importance_sampling is not None or "truncated_importance_sampling" in fields:
        return config
    return msgspec.structs.replace(config, truncated_importance_sampling=cap)
