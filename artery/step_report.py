"""What a finished step says to the program: a warning when it trained nothing, or dropped
trainable sequences (``Backend.train`` and ``train_sft`` report every step here)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from artery.backend_api import describe_drops, dropped_sequences

if TYPE_CHECKING:
    from artery.backend_api import TrainResult
    from artery.model import Model

#: Where a step that trained nothing (or lost sequences) is reported: a warning, which Python
#: prints to stderr when the program configured no logging. The logger keeps the backend's name,
#: the one programs already configure (and filter) for a backend's warnings.
log = logging.getLogger("artery.backend")


def report_step(model: Model, result: TrainResult) -> None:
    """Say it when a step trained nothing, or dropped trainable sequences.

    The step counter advances all the same, and a checkpoint is made of the unchanged adapter: ART's
    ``LocalBackend`` does so since its step-skipping change (``src/art/test/test_step_skipping.py``:
    0 -> 1 trained -> 2 skipped -> 3 trained, checkpoint 0002 being 0001's weights), so that
    ``get_step()`` counts the calls to ``train()`` and a program's own step arithmetic holds. What
    ART only prints ("Skipping tuning as there is no suitable data"), Artery also says in the result
    (``trained``, ``skip_reason``)."""
    name = f"{model.project}/{model.name}"
    if not result.trained:
        log.warning(
            "artery: step %d of %s trained nothing (tokens trained: %d): %s. The step advanced all "
            "the same (as ART's does); the adapter is unchanged.",
            result.step,
            name,
            int(result.metrics.get("tokens_trained", 0)),
            result.skip_reason,
        )
        return
    dropped = dropped_sequences(result.metrics)
    if dropped:
        log.warning(
            "artery: step %d of %s trained %d tokens, but dropped %d trainable sequences: %s",
            result.step,
            name,
            int(result.metrics.get("tokens_trained", 0)),
            sum(dropped.values()),
            describe_drops(dropped),
        )
