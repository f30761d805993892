"""Print the requirements of the project's core and the given extras, one per line, for
``pip install -r``: the Dockerfiles install them in a layer of their own before copying Artery's
sources, so a change to the sources rebuilds only the last layer (``pip install --no-deps .``),
not torch and the rest.

    python requirements.py cpu [pyproject.toml]

An extra that names the project itself (``artery[ml,serve]``) is resolved into those extras'
requirements. Standard library only: it runs in the bare base image.
"""

from __future__ import annotations

import re
import sys
import tomllib

SELF = re.compile(r"^\s*artery\s*\[([^\]]*)\]\s*$", re.IGNORECASE)


def requirements(project: dict, extras: list[str]) -> list[str]:
    optional = project.get("optional-dependencies", {})
    found: list[str] = list(project.get("dependencies", []))
    pending, seen = list(extras), set()
    while pending:
        extra = pending.pop(0)
        if extra in seen:
            continue
        if extra not in optional:
            raise SystemExit(f"pyproject.toml has no extra {extra!r} (it has {sorted(optional)})")
        seen.add(extra)
        for requirement in optional[extra]:
            named = SELF.match(requirement)
            if named:
                pending += [e.strip() for e in named[1].split(",") if e.strip()]
            elif requirement not in found:
                found.append(requirement)
    return found


def main(argv: list[str]) -> None:
    extras = [a for a in argv if not a.endswith(".toml")]
    path = next((a for a in argv if a.endswith(".toml")), "pyproject.toml")
    with open(path, "rb") as f:
        project = tomllib.load(f)["project"]
    print("\n".join(requirements(project, [e for a in extras for e in a.split(",") if e])))


if __name__ == "__main__":
    main(sys.argv[1:])
