"""Errors ART's SDK names in ``art.errors`` that mean the same on Artery."""

from __future__ import annotations


class LocalServingUnavailableError(RuntimeError):
    """The inference a ``LocalBackend`` serves could not start or stopped answering.

    As in ART, this ends a run instead of being counted as one failed rollout: every rollout after
    it would fail the same way. ``LocalBackend`` raises it when a replica it starts never becomes
    ready; ``PipelineTrainer`` raises it when a rollout cannot connect to that replica.
    """


def is_connection_failure(exc: BaseException) -> bool:
    """``exc``, or an error it was raised from, is a failed connection (``openai`` or ``httpx``)."""
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in seen:
        # By name: the SDK's core install has neither openai nor httpx to import the types from.
        if type(current).__name__ in ("APIConnectionError", "ConnectError"):
            return True
        seen.append(current)
        current = current.__cause__ or current.__context__
    return False
