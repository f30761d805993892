"""Stop strings: noticing one while tokens arrive, and cutting the text where it starts.

A completion that hits a stop string keeps, as token ids, every token that was sampled up to and
including the one that completed the stop string (those are what the model produced, and what a
trainer must score); its *text* ends just before the stop string, as OpenAI's API does.
"""

from __future__ import annotations


def tail_tokens(stops: tuple[str, ...]) -> int:
    """How many trailing tokens to decode to see any stop string that the last token completed.

    Every token but a skipped special token decodes to at least one byte and a character takes at
    most four, so ``4 * len(stop)`` tokens cover the string; the margin covers a character split
    across the start of the window.
    """
    return 4 * max((len(s) for s in stops), default=0) + 8


def first_stop(text: str, stops: tuple[str, ...]) -> int | None:
    """Where the earliest stop string starts in ``text``, or None."""
    found = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(found) if found else None


def trim_at_stop(text: str, stops: tuple[str, ...]) -> str:
    """``text`` cut just before its earliest stop string (unchanged when there is none)."""
    cut = first_stop(text, stops)
    return text if cut is None else text[:cut]
