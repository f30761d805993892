"""``art.LocalTrainResult``: what ``LocalBackend.train`` returns, ART's fields beside Artery's."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from artery.backend_api import TrainResult


@dataclass
class LocalTrainResult(TrainResult):
    """A ``TrainResult`` (step, metrics, trace, trained, skip_reason) and, as ART's, where the
    step's checkpoint is on this machine: the trainer's step directory (``adapter/`` inside)."""

    checkpoint_path: str | None = None

    @classmethod
    def at(cls, result: TrainResult, step_directory: Path) -> LocalTrainResult:
        path = step_directory if step_directory.is_dir() else None  # retention may have removed it
        return cls(**asdict(result), checkpoint_path=str(path) if path is not None else None)
