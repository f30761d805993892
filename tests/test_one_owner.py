"""One owner per concept, checked from the source: the served name ``<model>@<step>`` is written
and read only by ``shared.served_name``, and a uvicorn server is started only by ``shared.http``.
A second spelling drifts: one parser once took Unicode digits as a step."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("services", "shared", "artery")
LINKED = ("services", "shared", "schemas")

#: ``f"{model}@{step}"``: a served name formatted by hand.
_FORMATTED = re.compile(r"""f["'][^"'\n]*\}@\{""")
#: ``name.split("@")``, ``name.rpartition("@")`` and the like: a served name parsed by hand.
_PARSED = re.compile(r"""\.(r?split|r?partition)\(\s*["']@["']""")
#: A uvicorn server made anywhere but ``shared.http`` (the test kit's judge stub aside).
_UVICORN_SERVER = re.compile(r"uvicorn\.Server\(")


def _sources() -> dict[str, str]:
    found = {}
    for folder in FOLDERS:
        for path in (ROOT / folder).rglob("*.py"):
            relative = path.relative_to(ROOT)
            if folder == "artery" and relative.parts[1] in LINKED:
                continue  # the same file as under its own top-level folder
            found[relative.as_posix()] = path.read_text(encoding="utf-8")
    return found


def test_served_names_are_written_and_read_by_shared_served_name():
    offenders = [
        f"{path}:{text[: match.start()].count(chr(10)) + 1}: {match.group(0)}"
        for path, text in _sources().items()
        if path != "shared/served_name.py"
        for pattern in (_FORMATTED, _PARSED)
        for match in pattern.finditer(text)
    ]
    assert offenders == []


def test_http_servers_are_started_by_shared_http():
    offenders = [
        path
        for path, text in _sources().items()
        if _UVICORN_SERVER.search(text) and path not in {"shared/http.py", "artery/testing/judge.py"}
    ]
    assert offenders == []


def test_the_sdk_names_a_step_as_the_replicas_serve_it():
    from artery.model import Model
    from artery.shared.served_name import parse_served_name

    model = Model(name="agent-001", project="demo")
    assert model.get_inference_name() == "agent-001"
    assert model.get_inference_name(12) == "agent-001@12"
    assert parse_served_name(model.get_inference_name(12)) == ("agent-001", 12)
