"""``art.utils``: helpers for training scripts, as in ART (``iterate_dataset``,
``limit_concurrency``, ``retry``)."""

from artery.retry import retry
from artery.utils.iterate_dataset import DatasetBatch, iterate_dataset
from artery.utils.limit_concurrency import limit_concurrency

__all__ = ["DatasetBatch", "iterate_dataset", "limit_concurrency", "retry"]
