"""Print a virtualenv's installed distributions as a pip constraints file: ``name==version``,
sorted, the editable project itself left out.

    python constraints/freeze.py VENV 'what installs it' > constraints/setup.txt

Local version labels are dropped (``torch==2.13.0+cpu`` becomes ``torch==2.13.0``): ``==2.13.0``
still admits the ``+cpu`` build where an index offers it, and a machine whose index has only the
plain release takes that one. ``make lock`` runs this; standard library only.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def pins(freeze_output: str) -> list[str]:
    """``pip freeze`` lines as sorted ``name==version`` pins, without local labels."""
    found = []
    for line in freeze_output.splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "==" not in line:
            continue  # comments, and editable or direct-URL installs (the project itself)
        name, version = line.split("==", 1)
        found.append(f"{name.strip()}=={version.split('+', 1)[0].strip()}")
    return sorted(found, key=str.lower)


def main(venv: str, purpose: str) -> None:
    python = Path(venv) / "bin" / "python"
    frozen = subprocess.run(
        [str(python), "-m", "pip", "freeze", "--exclude-editable"], check=True, capture_output=True, text=True
    ).stdout
    print(f"# The versions `{purpose}` install (pip -c), written by `make lock`; edit by re-locking.")
    print("\n".join(pins(frozen)))


if __name__ == "__main__":
    main(*sys.argv[1:3])
