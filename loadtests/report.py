"""What every benchmark does at the end: print its table and keep its figures as JSON."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path


def report(result: dict, render: Callable[[dict], str], output: Path) -> dict:
    print(render(result), flush=True)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwritten to {output}", flush=True)
    return result
