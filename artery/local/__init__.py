"""``art.local``: where ART keeps ``LocalBackend`` (``from art.local import LocalBackend``).

Artery's ``LocalBackend`` starts the embedded stack (NATS, PostgreSQL, every service) as child
processes; it is the same class as ``artery.LocalBackend``.
"""

from artery.local.backend import LocalBackend
from artery.local.train_result import LocalTrainResult

__all__ = ["LocalBackend", "LocalTrainResult"]
