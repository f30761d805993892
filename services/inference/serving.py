"""What the HTTP layer serves: one engine, one model name, its adapters, and the pause gate's hook.

Served names: ``<model>`` is the latest step (the loaded adapter with the highest step, or the base
model when none is loaded); ``<model>@<step>`` is that step's adapter; ``<model>@0`` is the base
model, which also answers to the base model's own name (``base_model``, as registered: what a user
of the untrained model asks for), as the step-0 policy. The mapping is read from
``engine.adapters()`` on every request, so an adapter is served as soon as the engine has loaded it
under the name ``<model>@<step>``. A name served by none of these is a 404 that lists them; so is
a step not written as ``shared.served_name`` writes it (``agent@00``, ``agent@０``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass

from artery.services.inference.engine.base import Engine
from artery.shared.served_name import served_name, step_of


class EnginePaused(Exception):
    """The pause gate would not admit a request: inference stayed paused past the wait limit.

    ``retry_after`` (seconds), when the gate knows it (the lease's end), becomes ``Retry-After``.
    """

    def __init__(self, message: str = "", *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ModelNotFound(Exception):
    def __init__(self, name: str, served: list[str] | None = None) -> None:
        message = f"The model `{name}` does not exist"
        if served is not None:
            message += f"; this replica serves {', '.join(f'`{n}`' for n in served)} (see /v1/models)"
        super().__init__(message)
        self.name = name
        self.served = served


#: Admits one request: the body of ``async with admit():`` runs while inference is not paused (the
#: gate counts it as in flight until it exits); raises ``EnginePaused`` when the wait runs out.
AdmitHook = Callable[[], AbstractAsyncContextManager[None]]


@asynccontextmanager
async def admit_immediately() -> AsyncIterator[None]:
    yield


@dataclass(frozen=True)
class CheckpointLag:
    """The replica has served an older step than the newest published one for too long."""

    newest_step: int
    #: The newest step loaded; 0 while only the base model is served.
    served_step: int
    behind_s: float


@dataclass(frozen=True)
class Resolved:
    #: The concrete name that answered, ``<model>@<step>``; responses carry it in ``model``.
    served_name: str
    #: The engine's adapter name, None for the base model.
    adapter: str | None


class ServingState:
    """Everything ``create_app`` needs; ``admit``, ``is_paused``, ``checkpoint_lag`` and ``api_key``
    may be replaced later."""

    def __init__(
        self,
        engine: Engine,
        model: str,
        *,
        admit: AdmitHook = admit_immediately,
        is_paused: Callable[[], bool] = lambda: False,
        checkpoint_lag: Callable[[], CheckpointLag | None] = lambda: None,
        api_key: str | None = None,
        default_max_tokens: int = 4096,
        base_model: str | None = None,
    ) -> None:
        self.engine = engine
        self.model = model
        #: The base model's name as registered (a Hugging Face id or a path): the step-0 policy.
        self.base_model = base_model if base_model and base_model != model else None
        self.admit = admit
        self.is_paused = is_paused
        #: Not None while the replica lags behind training: ``/health`` is then a 503.
        self.checkpoint_lag = checkpoint_lag
        #: When set, every ``/v1`` request needs ``Authorization: Bearer <api_key>``.
        self.api_key = api_key
        #: Completion budget when a request sets no ``max_tokens`` (capped by the room left).
        self.default_max_tokens = default_max_tokens

    def steps(self) -> dict[int, str]:
        """Loaded adapters of this model by step: ``{3: "<model>@3"}``."""
        found: dict[int, str] = {}
        for name in self.engine.adapters():
            step = self._step_of(name)
            if step is not None and step > 0:
                found[step] = name
        return found

    def served(self) -> dict[str, str | None]:
        """Every name a request may use, mapped to its adapter (None: the base model)."""
        steps = self.steps()
        latest = steps[max(steps)] if steps else None
        names: dict[str, str | None] = {self.model: latest, served_name(self.model, 0): None}
        names.update({served_name(self.model, step): steps[step] for step in sorted(steps)})
        if self.base_model is not None:
            names[self.base_model] = None
        return names

    def resolve(self, name: str) -> Resolved:
        """The adapter a requested model name means now; raises ``ModelNotFound``."""
        steps = self.steps()
        step: int | None
        if name == self.model:
            step = max(steps, default=0)
        elif name == self.base_model:
            step = 0
        else:
            step = self._step_of(name)
            if step is None or (step != 0 and step not in steps):
                raise ModelNotFound(name, list(self.served()))
        return Resolved(served_name(self.model, step), steps.get(step))

    def _step_of(self, name: str) -> int | None:
        return step_of(name, self.model)
