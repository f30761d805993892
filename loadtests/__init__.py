"""Benchmarks, run by ``make bench`` (``python -m loadtests``).

Each benchmark is a module with ``main(argv) -> dict``: it starts its own private servers and
services, prints a table and writes its figures to ``loadtests/results/<name>.json``.
"""

from __future__ import annotations

from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"
