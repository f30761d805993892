"""Which base models a model may be registered on (pure: no NATS).

A model's ``base_model`` is what the trainer loads, so it is the operator's choice, never an
agent's: a name from the allow-list (``ARTERY_PUBLISHER_BASE_MODELS``), or a warm start from an
adapter the operator put under ``ARTERY_PUBLISHER_WARM_START_DIR/<project>/`` for the registering
project, itself on an allowed base. A path anywhere else, or another project's adapter, is refused.

On a bus without authentication the default is ``*``: whoever reaches such a bus may write the
registry anyway, so a check there would protect nothing and only break a single-user machine's
local directories.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from artery.shared import smollm2
from artery.shared.errors import InvalidMessage
from artery.shared.models import TINY, warm_start

ANY = "*"
#: What a cluster with authentication accepts unless its operator says otherwise.
EMBEDDED = frozenset((TINY, *smollm2.NAMES))


@dataclass(frozen=True)
class BaseModelPolicy:
    #: Allowed names; None: anything (``*``).
    names: frozenset[str] | None
    warm_start_dir: Path | None = None

    @classmethod
    def parse(cls, base_models: str | None, warm_start_dir: str | None, *, authenticated: bool):
        if base_models is None:
            base_models = ",".join(sorted(EMBEDDED)) if authenticated else ANY
        names = frozenset(n.strip() for n in base_models.split(",") if n.strip())
        root = Path(warm_start_dir).expanduser().resolve() if warm_start_dir else None
        return cls(None if ANY in names else names, root)

    def check(self, project: str, base_model: str | None) -> str | None:
        """The base model to record (a warm start as its resolved directory); ``InvalidMessage``
        (kind ``base_model``) when this project may not use it."""
        if base_model is None or self.names is None or base_model in self.names:
            return base_model
        adapter = self._own_adapter(project, base_model)
        if adapter is None:
            raise InvalidMessage(
                "base_model",
                f"{base_model!r} is not a base model of this cluster: one of {', '.join(sorted(self.names))}"
                + (
                    f", or an adapter under the warm-start directory of {project}"
                    if self.warm_start_dir
                    else ""
                ),
            )
        try:
            warm = warm_start(adapter)
        except (OSError, ValueError) as exc:
            raise InvalidMessage("base_model", f"warm start {base_model!r}: {exc}") from None
        if warm is None:
            raise InvalidMessage("base_model", f"{base_model!r} is not an adapter directory")
        if warm.base_model not in self.names:
            raise InvalidMessage(
                "base_model",
                f"warm start {base_model!r} is an adapter of {warm.base_model!r}, not an allowed base",
            )
        return str(adapter)

    def _own_adapter(self, project: str, base_model: str) -> Path | None:
        """The directory ``base_model`` names when it lies in ``project``'s warm-start directory
        (links resolved first: a link out of it is refused), else None."""
        if self.warm_start_dir is None or not Path(base_model).is_absolute():
            return None
        own = self.warm_start_dir / project
        path = Path(base_model).resolve()
        return path if path != own and path.is_relative_to(own) and path.is_dir() else None
