"""``art.Model`` and ``art.TrainableModel``: a named policy and where it lives."""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opentelemetry import trace

from artery import dev, integrations
from artery.dev import InternalModelConfig, LoRAConfig, lora_fields, model_config_fields
from artery.schemas.base import NAME_PATTERN
from artery.shared.tracing import inject, tracer
from artery.trajectories import Trajectory, TrajectoryGroup

if TYPE_CHECKING:
    from artery.backend_api import ModelBackend, TrainResult
    from artery.schemas import TrainConfig, TrainSFTConfig

import re

_NAME = re.compile(NAME_PATTERN)
_tracer = tracer("artery.sdk")


class Model:
    trainable = False

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
            if not _NAME.match(value):
                raise ValueError(f"model {label} {value!r} must match {NAME_PATTERN} (it is a subject token)")
        if config is not None:
            json.dumps(config)  # as ART: the config must be JSON-serialisable, checked early
        self.name = name
        self.project = project
        self.entity = entity
        self.id = id
        self.config = config
        self.inference_api_key = inference_api_key
        self.inference_base_url = inference_base_url
        self.inference_model_name = inference_model_name
        #: Where history.jsonl goes; unset, a LocalBackend's own path (as ART), else ``.artery``.
        self.base_path = base_path
        self.report_metrics = report_metrics
        self._backend: ModelBackend | None = None
        self._openai_client = None
        #: The endpoint came from the registry: requests follow its live replicas (``routing``).
        self._from_registry = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}(project={self.project!r}, name={self.name!r})"

    @property
    def backend(self) -> ModelBackend:
        if self._backend is None:
            raise RuntimeError(f"{self!r} is not registered: call `await model.register(backend)` first")
        return self._backend

    async def register(self, backend: ModelBackend) -> None:
        if self.base_path is None and isinstance(getattr(backend, "path", None), Path):
            self.base_path = str(backend.path)
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
                    lambda: self.backend.replicas(self),
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
        return self.name if step is None else f"{self.name}@{step}"

    async def get_step(self) -> int:
        if not self.trainable:
            return 0
        return await self.backend._get_step(self)

    async def publish(
        self, groups: TrajectoryGroup | Iterable[TrajectoryGroup], *, split: str = "train"
    ) -> list[str]:
        """Send finished groups to Artery (stored, then scored and trained on); return their ids."""
        if isinstance(groups, TrajectoryGroup):
            groups = [groups]
        return await self.backend.publish(self, groups, split=split)

    @property
    def directory(self) -> Path:
        return Path(self.base_path or ".artery") / self.project / "models" / self.name

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
        groups = _as_groups(trajectories)
        row = dict(metrics or {})
        if groups:
            row.update(summarize(groups))
            await self.publish([g for g in groups if len(g)], split=split)
        # Keys that already name a section ("loss/...", "train/...") keep it, as in ART.
        row = {k if "/" in k else f"{split}/{k}": v for k, v in row.items()}
        row = {k: v for k, v in row.items() if not (isinstance(v, float) and math.isnan(v))}
        step = await self.get_step() if step is None else step
        history_row = {"step": step, "recorded_at": time.time(), **row}
        _append_history(self.directory / "history.jsonl", history_row)
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
        # Validated now, so a typo or an unsupported key fails at construction, not in the trainer.
        internal = model_config_fields(_internal_config)
        if lora_config is not None and "lora" in internal:
            raise ValueError("give the adapter's shape once: lora_config or _internal_config['peft_args']")
        #: The adapter's shape (``LoRAConfig``); None: the trainer's defaults, or what it was registered with.
        self.lora_config: dict[str, Any] | None = (
            lora_fields(lora_config) if lora_config is not None else internal.get("lora")
        )
        #: Chat-template variables sent with every request of ``openai_client()`` (ART does the same).
        self.chat_template_kwargs: dict[str, Any] = internal.get("chat_template_kwargs", {})

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
        result = await self.backend.train(self, groups, config=config, **{**(_config or {}), **kwargs})
        row = {f"train/{k}": v for k, v in summarize(groups).items()}
        # A metric that names its section (``offpolicy/...``) keeps it, as in ``log``.
        row.update(
            {k if "/" in k else f"train/{k}": v for k, v in result.metrics.items() if k not in ("reward",)}
        )
        history_row = {"step": result.step, "recorded_at": time.time(), **row}
        _append_history(self.directory / "history.jsonl", history_row)
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
        result = await self.backend.train_sft(self, list(trajectories), config)
        row = {f"train/{k}": v for k, v in result.metrics.items()}
        history_row = {"step": result.step, "recorded_at": time.time(), **row}
        _append_history(self.directory / "history.jsonl", history_row)
        await integrations.report(self, history_row)  # W&B, when asked
        if verbose:
            print(
                f"sft step {result.step}: "
                + ", ".join(f"{k}={v:.4g}" for k, v in sorted(result.metrics.items()))
            )
        return result

    async def delete_checkpoints(
        self, best_checkpoint_metric: str | None = "reward_mean", *, keep_latest: int = 1
    ):
        """As ART: keep the latest step and the best one by ``best_checkpoint_metric`` (a metric of
        the training step, e.g. ``reward_mean``); every other adapter is deleted everywhere."""
        return await self.backend.delete_checkpoints(
            self, best_checkpoint_metric=best_checkpoint_metric, keep_latest=keep_latest
        )


def traced_transport(inner, *, body_defaults: dict[str, Any] | None = None):
    """An httpx transport that sends each request in a CLIENT span, with its ``traceparent``.

    ``body_defaults`` are added to every chat-completion request body that does not set them
    (ART's client does this for ``chat_template_kwargs``)."""
    import httpx

    class TracedTransport(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            path = request.url.path
            if body_defaults and request.method == "POST" and path.endswith("/chat/completions"):
                request = _with_body_defaults(request, body_defaults)
            name = "artery.completion" if path.endswith("completions") else f"artery.http {request.method}"
            with _tracer.start_as_current_span(
                name,
                kind=trace.SpanKind.CLIENT,
                attributes={
                    "http.request.method": request.method,
                    "url.path": path,
                    "server.address": request.url.host,
                },
            ) as span:
                request.headers.update(inject({}))
                response = await inner.handle_async_request(request)
                span.set_attribute("http.response.status_code", response.status_code)
                if response.status_code >= 500:
                    span.set_status(trace.StatusCode.ERROR)
                return response

        async def aclose(self) -> None:
            await inner.aclose()

    return TracedTransport()


def _with_body_defaults(request, defaults: dict[str, Any]):
    """The same request with ``defaults`` merged into its JSON body (keys it sets win)."""
    import httpx

    try:
        body = json.loads(request.content)
    except ValueError:
        return request  # not JSON: the server will say so
    if not isinstance(body, dict):
        return request
    body = {**defaults, **body}
    headers = [(k, v) for k, v in request.headers.multi_items() if k.lower() != "content-length"]
    return httpx.Request(request.method, request.url, headers=headers, content=json.dumps(body).encode())


def _append_history(path: Path, row: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def _as_groups(items) -> list[TrajectoryGroup]:
    if items is None:
        return []
    items = list(items)
    if all(isinstance(i, TrajectoryGroup) for i in items):
        return items
    return [TrajectoryGroup([t]) for t in items]


def summarize(groups: list[TrajectoryGroup]) -> dict[str, float]:
    """ART's averages: reward, exception_rate, each metric, reward_std_dev (within-group)."""
    trajectories = [t for g in groups for t in g]
    exceptions = sum(len(g.exceptions) for g in groups)
    out: dict[str, float] = {}
    if trajectories:
        out["reward"] = statistics.fmean(t.reward for t in trajectories)
        keys = {k for t in trajectories for k in t.metrics}
        for key in sorted(keys):
            values = [float(t.metrics[key]) for t in trajectories if key in t.metrics]
            out[key] = statistics.fmean(values)
        stds = [statistics.pstdev([t.reward for t in g]) for g in groups if len(g) > 1]
        if stds:
            out["reward_std_dev"] = statistics.fmean(stds)
    total = len(trajectories) + exceptions
    out["exception_rate"] = exceptions / total if total else 0.0
    return out
