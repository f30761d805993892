"""Every test module has a tier (``tests/tiers.py``), each tier is a registered marker that
``conftest.py`` applies, and ``make test-fast`` selects the tiers that need no servers."""

from __future__ import annotations

import re
from pathlib import Path

from tests.tiers import FAST_TIERS, SLOW_MODULES, TIER_OF_MODULE, TIERS

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def test_every_test_module_has_a_tier():
    modules = {path.name for path in TESTS.glob("test_*.py")}
    unplaced = sorted(modules - TIER_OF_MODULE.keys())
    assert not unplaced, f"add these to TIER_OF_MODULE in tests/tiers.py (its docstring says how): {unplaced}"
    gone = sorted(TIER_OF_MODULE.keys() - modules)
    assert not gone, f"tests/tiers.py names modules that no longer exist: {gone}"


def test_tiers_are_known_and_registered_markers(request):
    assert set(TIER_OF_MODULE.values()) <= set(TIERS)
    assert SLOW_MODULES <= TIER_OF_MODULE.keys()
    registered = {line.split(":", 1)[0].strip() for line in request.config.getini("markers")}
    assert set(TIERS) <= registered, "register every tier under markers in pyproject.toml"


def test_conftest_marks_each_test_with_its_modules_tier(request):
    assert request.node.get_closest_marker(TIER_OF_MODULE[Path(__file__).name]) is not None
    others = set(TIERS) - {TIER_OF_MODULE[Path(__file__).name]}
    assert not [m.name for m in request.node.iter_markers() if m.name in others]


def test_make_test_fast_runs_exactly_the_fast_tiers():
    target = re.search(r"^test-fast:.*?(?=^\S|\Z)", (ROOT / "Makefile").read_text(), re.M | re.S)
    assert target, "the Makefile has a test-fast target"
    expression = re.search(r"-m '([^']*)'", target.group(0))
    assert expression, "test-fast selects tiers with -m '<expression>'"
    assert set(re.findall(r"\w+", expression.group(1))) & set(TIERS) == set(FAST_TIERS)
