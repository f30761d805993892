"""Every Python package in the repo is listed in pyproject.toml, so a built wheel is complete."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_package_folder_is_in_the_distribution():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    mapping = config["package-dir"]
    found = set()
    for import_name, folder in mapping.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            if "node_modules" in init.parts:
                continue
            relative = init.parent.relative_to(ROOT / folder)
            found.add(".".join([import_name, *relative.parts]))
    assert found - listed == set(), f"add to [tool.setuptools] packages: {sorted(found - listed)}"
