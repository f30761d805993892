"""What every benchmark does at the end: print its table and keep its figures as JSON."""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any


def load_average() -> float | None:
    """The 1-minute load average (what else was running shapes every figure), where there is one."""
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def machine(load_before: float | None, **extra: Any) -> dict:
    """The ``machine`` block of a result: where and under what load the figures were taken."""
    return {
        "cpu_count": os.cpu_count(),
        "load_average_1m_before": load_before,
        "platform": platform.platform(),
        "python": platform.python_version(),
        **extra,
    }


def report(result: dict, render: Callable[[dict], str], output: Path) -> dict:
    print(render(result), flush=True)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwritten to {output}", flush=True)
    return result
