"""Which base weights a model record may name, checked before anything it names is opened.

A model's record is written for an agent, so its ``base_model`` is the agent's choice: used as a
path, it once warm-started one project from another project's checkpoints (their layout is
predictable) and had the trainer open ``/etc/shadow``. The operator names what may be trained on
(``ARTERY_TRAINER_BASE_MODELS``, the publisher's rule at registration, checked again here where
the weights are opened):

- a name on the list (``artery/tiny-random``, ``SmolLM2-135M-Instruct``, a Hugging Face name in
  the local cache);
- a warm start from an adapter of the project's own: in its checkpoints
  (``<checkpoint_dir>/<project>/...``) or under ``ARTERY_TRAINER_WARM_START_DIR/<project>/``,
  whose own base is on the list;
- ``*`` on the list: any name and any directory (a bus without authentication, whose agents are
  its operator).

Whatever the list, a path must be a directory (never a file), and another project's checkpoints
or warm-start adapters are refused.
"""

from __future__ import annotations

import json
from pathlib import Path

from artery.services.trainer.settings import TrainerSettings
from artery.shared import smollm2
from artery.shared.models import ADAPTER_CONFIG, TINY

ANY = "*"
#: What a bus with authentication allows unless its operator says otherwise.
EMBEDDED = (TINY, *smollm2.NAMES)


class BaseModelRefused(ValueError):
    """The record names base weights the operator does not allow for this project."""


def allowed_names(settings: TrainerSettings) -> list[str]:
    """The list; unset (a trainer built without ``main``'s resolution): the embedded names."""
    listed = settings.base_models if settings.base_models is not None else ",".join(EMBEDDED)
    return [entry.strip() for entry in listed.split(",") if entry.strip()]


def check_base_model(settings: TrainerSettings, project: str, base_model: str) -> None:
    """Raise ``BaseModelRefused`` unless ``project`` may train on ``base_model``."""
    names = allowed_names(settings)
    path = _as_path(base_model)
    if path is None:  # a name
        if base_model in names or ANY in names:
            return
        raise BaseModelRefused(_not_allowed(base_model, names))
    if not path.is_dir():
        raise BaseModelRefused(f"base model {base_model!r} is a path, and not a directory of weights")
    own = [_resolved(settings.checkpoint_dir) / project]
    others = [_resolved(settings.checkpoint_dir)]
    if settings.warm_start_dir:
        own.append(_resolved(settings.warm_start_dir) / project)
        others.append(_resolved(settings.warm_start_dir))
    if any(_within(path, root) and path != root for root in own):
        _check_adapter_base(path, names)
        return
    if any(_within(path, root) for root in others):
        raise BaseModelRefused(f"base model {base_model!r} is not one of project {project!r}'s own adapters")
    if ANY in names:
        _check_adapter_base(path, names)
        return
    raise BaseModelRefused(_not_allowed(base_model, names))


def _check_adapter_base(path: Path, names: list[str]) -> None:
    """A warm-start adapter names its base weights: those must be allowed too."""
    config_file = path / ADAPTER_CONFIG
    if not config_file.is_file() or (path / "config.json").is_file():
        return  # full weights, not an adapter
    try:
        base = json.loads(config_file.read_text()).get("base_model_name_or_path")
    except (ValueError, AttributeError) as exc:
        raise BaseModelRefused(f"{path}: {ADAPTER_CONFIG} is not a JSON object: {exc}") from exc
    if not isinstance(base, str) or not base:
        raise BaseModelRefused(f"{path}: {ADAPTER_CONFIG} names no base_model_name_or_path")
    if ANY in names:
        inner = _as_path(base)
        if inner is not None and not inner.is_dir():
            raise BaseModelRefused(f"{path} is an adapter on {base!r}, which is not a directory of weights")
        return
    if base not in names:
        raise BaseModelRefused(f"{path} is an adapter on {base!r}, which is not allowed: {_listed(names)}")


def _as_path(name: str) -> Path | None:
    """``name`` as a filesystem path when it is one (absolute, home- or dot-relative, or an existing
    entry); None for a model name (``org/name`` that is not there)."""
    if name.startswith(("/", "~", ".")) or "\\" in name or Path(name).expanduser().exists():
        return _resolved(name)
    return None


def _resolved(path: str | Path) -> Path:
    """Links resolved first: a link out of an allowed directory is judged where it leads."""
    return Path(path).expanduser().resolve()


def _within(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def _listed(names: list[str]) -> str:
    return ", ".join(names) if names else "(none)"


def _not_allowed(base_model: str, names: list[str]) -> str:
    return (
        f"base model {base_model!r} is not allowed on this trainer (ARTERY_TRAINER_BASE_MODELS):"
        f" {_listed(names)}"
    )
