"""The versions ``make setup`` and ``make setup-vllm`` install are the ones in ``constraints/``:
every requirement those targets ask for is pinned there, within its range, so a fresh clone
installs what CI tested and a new release upstream changes nothing until ``make lock`` takes it."""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.helpers import load_script

ROOT = Path(__file__).resolve().parent.parent
PIN = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>[0-9][^\s+;#]*)$")


def makefile_value(variable: str) -> str:
    found = re.search(rf"^{variable} := (.*)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert found, f"Makefile has no {variable}"
    return found[1].strip()


def locked(name: str) -> dict[str, Version]:
    """A constraints file as {canonical name: version}; every line a comment or an exact pin."""
    pins: dict[str, Version] = {}
    for line in (ROOT / "constraints" / name).read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        pin = PIN.match(line.strip())
        assert pin, f"constraints/{name}: {line!r} is not name==version (no local label, no URL)"
        pins[canonicalize_name(pin["name"])] = Version(pin["version"])
    return pins


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def asked_by_setup() -> list[Requirement]:
    """The core, ``make setup``'s extras (their links to other extras resolved, as the Dockerfiles
    resolve them) and ``make prepare-model``'s converter."""
    lister = load_script(ROOT / "compose" / "requirements.py", "compose_requirements")
    extras = makefile_value("SETUP_EXTRAS").split(",")
    tools = shlex.split(makefile_value("SMOLLM2_TOOLS"))
    return [Requirement(r) for r in lister.requirements(project(), extras) + tools]


def asked_by_setup_vllm() -> list[Requirement]:
    words = shlex.split(makefile_value("VLLM_REQUIREMENTS"))
    direct = [w for w in words if not w.startswith("-") and not w.startswith(".")]
    serve = project()["optional-dependencies"]["serve"]
    return [Requirement(r) for r in direct + serve]


@pytest.mark.parametrize(
    ("lock", "asked"),
    [("setup.txt", asked_by_setup), ("vllm.txt", asked_by_setup_vllm)],
    ids=["setup", "vllm"],
)
def test_every_requirement_is_pinned_within_its_range(lock, asked):
    pins = locked(lock)
    requirements = asked()
    assert len(requirements) > 5  # the Makefile and pyproject were read
    unpinned = [str(r) for r in requirements if canonicalize_name(r.name) not in pins]
    assert not unpinned, f"not in constraints/{lock} (run `make lock`): {unpinned}"
    outside = [
        f"{r} (locked {pins[canonicalize_name(r.name)]})"
        for r in requirements
        if not r.specifier.contains(pins[canonicalize_name(r.name)], prereleases=True)
    ]
    assert not outside, f"constraints/{lock} pins outside pyproject's range (run `make lock`): {outside}"


def test_every_install_of_the_makefile_takes_its_lock():
    """Each ``pip install`` line of the Makefile but the lock's own (which resolves the newest)
    passes ``-c`` with a constraints file."""
    lines = [line.strip() for line in (ROOT / "Makefile").read_text().splitlines()]
    installs = [line for line in lines if "pip install" in line and "--upgrade pip" not in line]
    unlocked = [line for line in installs if "-c $(" not in line and "$(LOCK_VENV)" not in line]
    assert len(installs) >= 4 and not unlocked, f"installs without constraints: {unlocked}"


def test_freeze_drops_local_labels_and_the_editable_project():
    freeze = load_script(ROOT / "constraints" / "freeze.py", "constraints_freeze")
    output = "\n".join(
        [
            "# Editable install with no version control (artery==0.1.0)",
            "-e /somewhere/artery",
            "torch==2.13.0+cpu",
            "Accelerate==1.15.0",
            "msgspec==0.23.0",
        ]
    )
    assert freeze.pins(output) == ["Accelerate==1.15.0", "msgspec==0.23.0", "torch==2.13.0"]
