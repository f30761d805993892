"""Benchmarks, run by ``make bench`` (``python -m loadtests``).

Each benchmark is a module with ``main(argv) -> dict``: it starts its own private servers and
services, prints a table and writes its figures to ``loadtests/results/<name>.json``. What they
share (stack start-up, machine info, result writing, the wire-object builders) is ``harness``.
"""

from __future__ import annotations

from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"
