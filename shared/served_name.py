"""Served names: ``<model>@<step>``, the one spelling of a policy step, written and read here.

A step is written in ASCII digits without leading zeros (``0`` alone is step 0). Reading is as
strict as writing, so that one step has one name: Python's ``str.isdigit`` and ``int`` (and the
regex ``\\d``) also take ``０`` (fullwidth), ``٠`` (Arabic-Indic) and ``00``, which would otherwise
all be served, routed and counted as step 0 under names nothing else writes.

A model name may hold dots (``agent-1.5@3``) but never ``@`` (``schemas.base.NAME_PATTERN``), so
the last ``@`` always separates the model from the step.
"""

from __future__ import annotations

import re

SEPARATOR = "@"

_STEP = re.compile(r"0|[1-9][0-9]*", re.ASCII)


def served_name(model: str, step: int) -> str:
    """``<model>@<step>``."""
    if step < 0:
        raise ValueError(f"a step is never negative, got {step}")
    return f"{model}{SEPARATOR}{step}"


def parse_step(text: str) -> int | None:
    """The step ``text`` spells in the canonical form, else None."""
    return int(text) if _STEP.fullmatch(text) else None


def parse_served_name(name: str) -> tuple[str, int] | None:
    """``(model, step)`` for ``<model>@<step>`` with a canonical step, else None (a bare model
    name, a step in other digits or with leading zeros, an empty model)."""
    model, at, step_text = name.rpartition(SEPARATOR)
    if not at or not model:
        return None
    step = parse_step(step_text)
    return None if step is None else (model, step)


def step_of(name: str, model: str) -> int | None:
    """The step ``name`` serves of ``model``: ``<model>@<step>`` read strictly, else None."""
    parsed = parse_served_name(name)
    return parsed[1] if parsed is not None and parsed[0] == model else None
