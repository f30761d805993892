"""Every Python package in the repo is listed in pyproject.toml, so a built wheel is complete."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_package_folder_is_in_the_distribution():
    """Every folder with an ``__init__.py`` under ``artery/``, through the links to ``services/``,
    ``shared/`` and ``schemas/`` (the import names are the paths), is a listed package."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = set()
    for folder, dirs, files in os.walk(ROOT / "artery", followlinks=True):
        dirs[:] = [d for d in dirs if d not in ("node_modules", "__pycache__")]
        if "__init__.py" in files:
            found.add(".".join(Path(folder).relative_to(ROOT).parts))
    assert "artery.services.trainer" in found  # the links were followed
    assert found - listed == set(), f"add to [tool.setuptools] packages: {sorted(found - listed)}"
