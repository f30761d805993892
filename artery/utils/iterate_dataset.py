"""``iterate_dataset``: a dataset in steps of ``groups_per_step`` items over several epochs."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from tqdm.auto import tqdm

T = TypeVar("T")


@dataclass
class DatasetBatch(Generic[T]):
    """One step's items, with where it stands: ``step`` counts across epochs from 0."""

    items: list[T]
    step: int
    epoch: int
    epoch_step: int
    #: All steps of the iteration (later ART versions carry it, for learning-rate schedules).
    total_steps: int | None = None


def iterate_dataset(
    dataset: Sequence[T],
    groups_per_step: int = 1,
    num_epochs: int = 1,
    initial_step: int = 0,
    use_tqdm: bool = True,
) -> Iterator[DatasetBatch[T]]:
    """Yield ``DatasetBatch``es of ``groups_per_step`` items (an epoch's last may be shorter).

    Each epoch visits every item once, in an order shuffled with the epoch number as the seed:
    the same permutation as ART's ``random.seed(epoch); random.shuffle(...)``, without touching
    the global ``random`` state. Steps before ``initial_step`` are skipped, so a resumed run
    (``initial_step=await model.get_step()``) gets exactly the batches it had not had yet.
    """
    if groups_per_step < 1:
        raise ValueError("groups_per_step must be at least 1")
    if num_epochs < 0 or initial_step < 0:
        raise ValueError("num_epochs and initial_step must be >= 0")
    size = len(dataset)
    if size == 0:
        return
    steps_per_epoch = math.ceil(size / groups_per_step)
    total_steps = steps_per_epoch * num_epochs
    bar = (
        tqdm(
            initial=min(initial_step, total_steps), total=total_steps, desc="Iterating dataset", unit="batch"
        )
        if use_tqdm
        else None
    )
    try:
        for epoch in range(initial_step // steps_per_epoch, num_epochs):
            order = list(range(size))
            random.Random(epoch).shuffle(order)
            for epoch_step in range(steps_per_epoch):
                step = epoch * steps_per_epoch + epoch_step
                if step < initial_step:
                    continue
                start = epoch_step * groups_per_step
                yield DatasetBatch(
                    items=[dataset[i] for i in order[start : start + groups_per_step]],
                    step=step,
                    epoch=epoch,
                    epoch_step=epoch_step,
                    total_steps=total_steps,
                )
                if bar is not None:
                    bar.update(1)
    finally:
        if bar is not None:
            bar.close()
