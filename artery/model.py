"""``art.Model`` and ``art.TrainableModel``: a named policy and where it lives."""

from __future__ import annotations

import copy
import json
import math
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from artery import dev, integrations
from artery.dev import InternalModelConfig, LoRAConfig, lora_fields, model_settings, note_no_effect
from artery.model_transport import traced_transport
from artery.schemas.base import check_name
from artery.shared.served_name import served_name
from artery.trajectories import Trajectory, TrajectoryGroup, require_rewards
from artery.utils.art_settings import with_server_config
from artery.utils.model_files import (
    ModelFiles,
    append_history,
    as_groups,
    best_step_in_history,
    jsonable,
    summarize,
)

if TYPE_CHECKING:
    from artery.backend_api import ModelBackend, TrainResult
    from artery.schemas import TrainConfig, TrainSFTConfig

#: ART's default directory for model files (``.art/<project>/models/<name>/``).
DEFAULT_BASE_PATH = ".art"


class Model(ModelFiles):
    trainable = False
    _wandb_run: Any = None  # artery.integrations.wandb's run for this model, and whether opening
    _wandb_failed = False  # one failed

    def __init__(
        self,
        *,
        name: str,
        project: str,
        entity: str | None = None,
        id: str | None = None,
        config: dict[str, Any] | None = None,
        inference_api_key: str | None = None,
        inference_base_url: str | None = None,
        inference_model_name: str | None = None,
        base_path: str | None = None,
        report_metrics: list[str] | None = None,
    ):
        for label, value in (("name", name), ("project", project)):
            check_name(f"model {label}", value)
        if config is not None:
            json.dumps(jsonable(config))  # as ART: the config must be JSON-serialisable, checked early
        self.name = name
        self.project = project
        self.entity = entity
        self.id = id
        self.config = config
        self.inference_api_key = inference_api_key
        self.inference_base_url = inference_base_url
        self.inference_model_name = inference_model_name
        #: Where history.jsonl and state.json go; unset, a LocalBackend's own path (as ART), else ``.art``.
        self.base_path = base_path
        self.report_metrics = report_metrics
        self._backend: ModelBackend | None = None
        self._openai_client = None
        #: The endpoint came from the registry: requests follow its live replicas (``routing``).
        self._from_registry = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}(project={self.project!r}, name={self.name!r})"

    def backend(self) -> ModelBackend:
        """The backend the model is registered with (a method, as in ART)."""
        if self._backend is None:
            raise RuntimeError(f"{self!r} is not registered: call `await model.register(backend)` first")
        return self._backend

    def model_dump(self, *, mode: str = "python", exclude_none: bool = False) -> dict[str, Any]:
        """The model's fields as a dict (ART's ``Model`` is a pydantic model)."""
        config: Any = self.config  # ART's configs are pydantic models
        if hasattr(config, "model_dump"):
            config = config.model_dump(mode=mode)
        data = {
            "name": self.name,
            "project": self.project,
            "entity": self.entity,
            "id": self.id,
            "config": copy.deepcopy(config),
            "inference_api_key": self.inference_api_key,
            "inference_base_url": self.inference_base_url,
            "inference_model_name": self.inference_model_name,
            "base_path": self.base_path,
            "report_metrics": self.report_metrics,
            "trainable": self.trainable,
        }
        return {k: v for k, v in data.items() if v is not None} if exclude_none else data

    def model_dump_json(self, **kwargs) -> str:
        return json.dumps(self.model_dump(mode="json", **kwargs))

    async def register(self, backend: ModelBackend) -> None:
        for label, value in (("name", self.name), ("project", self.project)):  # changed after a copy
            check_name(f"model {label}", value)
        if self.base_path is None:  # a LocalBackend's: ART's .art, or the path it was given
            path = getattr(backend, "models_path", None) or getattr(backend, "path", None)
            if isinstance(path, Path):
                self.base_path = str(path)
        await backend.register(self)
        self._backend = backend
        if self.trainable and self.inference_base_url is None:
            self.inference_base_url = await backend._inference_url(self)
            self._from_registry = self.inference_base_url is not None and not getattr(
                backend, "inference_url", None
            )
            self.inference_api_key = self.inference_api_key or backend.inference_api_key
            self.inference_model_name = self.inference_model_name or self.name

    def openai_client(self):
        """An ``openai.AsyncOpenAI`` for this model's inference endpoint (cached, as in ART).

        Its responses carry the sampled ``token_ids`` on each choice; append the choices to a
        ``Trajectory`` and training uses exactly those tokens. Each request runs in an
        ``artery.completion`` span and sends its ``traceparent``: the replica's span continues it.
        """
        if self._openai_client is None:
            import httpx
            import openai

            from artery.routing import ReplicaRouter

            if self.inference_base_url is None:
                raise RuntimeError(f"{self!r} has no inference endpoint: register it with a backend first")
            transport = httpx.AsyncHTTPTransport(
                limits=httpx.Limits(max_connections=100_000, max_keepalive_connections=100_000)
            )
            if self._from_registry:
                transport = ReplicaRouter(
                    transport,
                    lambda: self.backend().replicas(self),
                    base_path=httpx.URL(self.inference_base_url).path,
                )
            self._openai_client = openai.AsyncOpenAI(
                base_url=self.inference_base_url,
                api_key=self.inference_api_key or "artery",
                http_client=httpx.AsyncClient(
                    timeout=httpx.Timeout(timeout=1200, connect=5.0),
                    transport=traced_transport(
                        transport,
                        body_defaults={"chat_template_kwargs": self.chat_template_kwargs}
                        if getattr(self, "chat_template_kwargs", None)
                        else None,
                    ),
                ),
            )
        return self._openai_client

    def litellm_completion_params(self, step: int | None = None) -> dict[str, Any]:
        """Keyword arguments for ``litellm.acompletion`` against this model (as in ART)."""
        name = self.get_inference_name(step) if self.trainable else (self.inference_model_name or self.name)
        return {
            "model": f"hosted_vllm/{name}",
            "base_url": self.inference_base_url,
            "api_key": self.inference_api_key or "artery",
            "temperature": 1,
        }

    def get_inference_name(self, step: int | None = None) -> str:
        """``name@step``, or the bare name for the latest step."""
        return self.name if step is None else served_name(self.name, step)

    async def get_step(self) -> int:
        if not self.trainable:
            return 0
        return await self.backend()._get_step(self)

    async def publish(
        self, groups: TrajectoryGroup | Iterable[TrajectoryGroup], *, split: str = "train"
    ) -> list[str]:
        """Send finished groups to Artery (stored, then scored and trained on); return their ids."""
        groups = [groups] if isinstance(groups, TrajectoryGroup) else list(groups)
        require_rewards(groups)
        return await self.backend().publish(self, groups, split=split)

    @property
    def directory(self) -> Path:
        return Path(self.base_path or DEFAULT_BASE_PATH) / self.project / "models" / self.name

    async def log(
        self,
        trajectories: Iterable[Trajectory] | Iterable[TrajectoryGroup] | None = None,
        split: str = "val",
        *,
        metrics: dict[str, float] | None = None,
        step: int | None = None,
    ) -> dict[str, float]:
        """Record metrics for ``step`` in ``history.jsonl`` and store the trajectories.

        As in ART: the mean reward, the exception rate, every trajectory metric and the mean
        within-group reward std are averaged and prefixed with ``split/``. The groups are
        published with that split, so they are kept in PostgreSQL but not trained on (unless
        the split is ``train``), and written to ``trajectories/{split}/{step:04d}.parquet`` in
        the model directory (ART's layout, ``artery.parquet``; needs pyarrow).
        """
        groups = as_groups(trajectories)
        row = dict(metrics or {})
        if groups:
            row.update(summarize(groups))
            await self.publish([g for g in groups if len(g)], split=split)
        # Keys that already name a section ("loss/...", "train/...") keep it, as in ART.
        row = {k if "/" in k else f"{split}/{k}": v for k, v in row.items()}
        row = {k: v for k, v in row.items() if not (isinstance(v, float) and math.isnan(v))}
        step = await self.get_step() if step is None else step
        history_row = {"step": step, "recorded_at": time.time(), **row}
        append_history(self.directory / "history.jsonl", history_row)
        await integrations.report(self, history_row, groups, split)  # W&B, when asked
        if groups:
            # ART's layout beside history.jsonl; after it, so the metrics are kept even without pyarrow.
            from artery.parquet import write_trajectory_groups_parquet

            path = self.directory / "trajectories" / split / f"{step:04d}.parquet"
            write_trajectory_groups_parquet(groups, path)
        return row


class TrainableModel(Model):
    trainable = True

    def __init__(
        self,
        *,
        name: str,
        project: str,
        base_model: str,
        run_id: str | None = None,
        lora_config: LoRAConfig | None = None,
        _internal_config: InternalModelConfig | None = None,
        **kwargs,
    ):
        super().__init__(name=name, project=project, **kwargs)
        self.base_model = base_model
        self.run_id = run_id
        #: The adapter's shape given as ``lora_config`` (``peft_args`` may give it instead).
        self._lora_given = lora_fields(lora_config) if lora_config is not None else None
        # Mapped now, so a bad value fails at construction, not in the trainer.
        self._internal_config = _internal_config

    @property
    def _internal_config(self) -> InternalModelConfig | None:
        """ART's ``_internal_config``: set at construction or afterwards (as ART's examples do),
        it is mapped at once (``artery.dev.model_settings``) and applied at ``register()``."""
        return self._internal

    @_internal_config.setter
    def _internal_config(self, config: InternalModelConfig | None) -> None:
        settings = model_settings(config)
        if self._lora_given is not None and settings.lora is not None:
            raise ValueError("give the adapter's shape once: lora_config or _internal_config['peft_args']")
        if getattr(self, "_backend", None) is not None:
            note_no_effect("_internal_config set after register()", "it applies at the next register()")
        self._internal = config
        self._settings = settings
        #: The adapter's shape (``LoRAConfig``); None: the trainer's defaults, or what it was registered with.
        self.lora_config: dict[str, Any] | None = (
            self._lora_given if self._lora_given is not None else settings.lora
        )
        #: Chat-template variables sent with every request of ``openai_client()`` (ART does the same).
        self.chat_template_kwargs: dict[str, Any] = settings.chat_template_kwargs

    def model_dump(self, *, mode: str = "python", exclude_none: bool = False) -> dict[str, Any]:
        data = super().model_dump(mode=mode, exclude_none=exclude_none)
        data.update(base_model=self.base_model, _internal_config=copy.deepcopy(self._internal))
        return data

    async def register(
        self, backend: ModelBackend, _openai_client_config: dev.OpenAIServerConfig | None = None
    ):
        """Record the model and start what serves it (a ``LocalBackend``: the stack, its replica).

        Before anything starts, a base model that cannot be loaded here fails, naming the ways to
        provide one; the ``_internal_config`` knobs Artery has reach the services it starts."""
        from artery.utils.base_model import check_base_model
        from artery.utils.service_settings import apply_model_settings

        if _starts_services_here(backend):
            check_base_model(self.base_model)
        settings = self._settings
        if _openai_client_config:
            settings = with_server_config(settings, _openai_client_config)
        apply_model_settings(backend, self, settings)
        await super().register(backend)

    async def train(
        self,
        trajectory_groups: Iterable[TrajectoryGroup],
        config: TrainConfig | None = None,
        _config: dev.TrainConfig | None = None,
        *,
        verbose: bool = False,
        **kwargs,
    ) -> TrainResult:
        """One training step on the groups, as in ART 0.4: returns when the new adapter is served.

        ``_config`` (``art.dev.TrainConfig``) and keyword arguments are ART's advanced settings,
        translated or refused by name (``artery.dev``).

        The step's metrics (and the groups' averages) are logged under ``train/`` in
        ``history.jsonl``, so ``delete_checkpoints`` can pick the best step.
        """
        groups = list(trajectory_groups)
        fields = {**(_config or {}), **kwargs}
        for key, value in self._settings.train_defaults.items():  # trainer_args: the model's defaults
            if key not in fields and (config is None or getattr(config, key, None) is None):
                fields[key] = value
        result = await self.backend().train(self, groups, config=config, **fields)
        row = {f"train/{k}": v for k, v in summarize(groups).items()}
        # A metric that names its section (``offpolicy/...``) keeps it, as in ``log``.
        row.update(
            {k if "/" in k else f"train/{k}": v for k, v in result.metrics.items() if k not in ("reward",)}
        )
        history_row = {"step": result.step, "recorded_at": time.time(), **row}
        append_history(self.directory / "history.jsonl", history_row)
        await integrations.report(self, history_row, groups, "train")  # W&B, when asked
        if verbose:
            print(
                f"step {result.step}: " + ", ".join(f"{k}={v:.4g}" for k, v in sorted(result.metrics.items()))
            )
        return result

    async def train_sft(
        self,
        trajectories: Iterable[Trajectory],
        config: TrainSFTConfig | None = None,
        _config: dict[str, Any] | None = None,
        verbose: bool = False,
    ) -> TrainResult:
        """Supervised fine-tuning, as ART's ``train_sft``: cross-entropy on the assistant turns of
        ``trajectories`` (in order, ``config.batch_size`` per update, ``config.learning_rate`` one
        rate or one per batch). One step: returns when the new adapter is served.

        The step's metrics are logged under ``train/`` in ``history.jsonl``, as ``train()``'s.
        ``_config`` (ART's ``dev.TrainSFTConfig``) has no setting Artery honours: it must be empty.
        """
        if _config:
            raise ValueError(f"train_sft(_config=...): no setting of {sorted(_config)} is supported")
        result = await self.backend().train_sft(self, list(trajectories), config)
        row = {f"train/{k}": v for k, v in result.metrics.items()}
        history_row = {"step": result.step, "recorded_at": time.time(), **row}
        append_history(self.directory / "history.jsonl", history_row)
        await integrations.report(self, history_row)  # W&B, when asked
        if verbose:
            print(
                f"sft step {result.step}: "
                + ", ".join(f"{k}={v:.4g}" for k, v in sorted(result.metrics.items()))
            )
        return result

    async def delete_checkpoints(self, best_checkpoint_metric: str | None = None, *, keep_latest: int = 1):
        """As ART: keep the latest step and the best one by ``best_checkpoint_metric``; every other
        adapter is deleted everywhere.

        The metric is looked up first in ``history.jsonl`` (what ``model.log()`` and ``train()``
        wrote: ``"val/reward"``, ``"train/reward"``), by its mean per step as ART does, then among
        the trainer's own step metrics (``"reward_mean"``). Unset, it is ART's default
        ``"val/reward"`` when the history has it, else the trainer's ``"reward_mean"``."""
        metric = best_checkpoint_metric
        history = self.directory / "history.jsonl"
        best = best_step_in_history(history, metric or "val/reward")
        backend = self.backend()
        if best is not None:
            applied = await backend.delete_checkpoints(
                self, best_checkpoint_metric=None, keep_latest=keep_latest, keep_steps=[best]
            )
            if best not in applied.kept:  # Artery's publisher retains on its own after each step
                print(f"best step {best} was deleted already (ARTERY_PUBLISHER_KEEP_LATEST, _BEST_METRIC)")
            return _with_best(applied, best)
        applied = await backend.delete_checkpoints(
            self, best_checkpoint_metric=metric or "reward_mean", keep_latest=keep_latest
        )
        if metric is not None and applied.best_step is None:
            print(f'No "{metric}" metric found in history')  # ART's words; the latest step is kept
        return applied


def _starts_services_here(backend) -> bool:
    """Whether ``backend`` runs the trainer and replicas on this machine (a ``LocalBackend``,
    told by its embedded stack: ``artery.local`` is not imported here, it imports this module)."""
    return getattr(backend, "stack", None) is not None


def _with_best(applied, best: int):
    import msgspec

    return msgspec.structs.replace(applied, best_step=best if best in applied.kept else None)
