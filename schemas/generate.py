"""Write the wire-contract documents under ``generated/`` from the Structs of this package.

    python -m artery.schemas.generate           # rewrite the documents
    python -m artery.schemas.generate --check   # write nothing; exit 1 when the committed ones drift

It writes ``jsonschema/<tag>.json`` (JSON Schema 2020-12, one per event, and ``<Name>.json`` for
each KV value type) and ``asyncapi.json`` (AsyncAPI 3.0.0: the server, every subject, stream,
payload and header). All of it is derived from code (this package, the subject functions of
``shared.subjects``, the header names of ``shared.bus``), so the documents a Go or Node publisher
reads cannot say something the services do not do. This module, ``json_schemas`` and
``asyncapi`` are the dev-time modules of ``schemas/`` (``json_schemas.DEV_TIME_MODULES``): the
only ones that read ``artery.shared``; nothing at run time imports them.

Output is deterministic (sorted keys, no timestamps) so that the drift check is a plain
byte comparison. The documents are built by ``json_schemas`` (the types and their JSON Schema)
and ``asyncapi`` (the AsyncAPI document); this module writes and checks them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from artery.schemas.asyncapi import HEADERS_SCHEMA as HEADERS_SCHEMA
from artery.schemas.asyncapi import PARAMETERS as PARAMETERS
from artery.schemas.asyncapi import asyncapi
from artery.schemas.json_schemas import KV_VALUES, json_schema
from artery.schemas.json_schemas import event_types as event_types
from artery.schemas.json_schemas import tag as tag

GENERATED_DIR = Path(__file__).parent / "generated"


def _dump(doc: dict) -> str:
    return json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def render() -> dict[str, str]:
    """Every generated file, by path relative to the output folder."""
    files = {f"jsonschema/{tag(cls)}.json": _dump(json_schema(cls, tag(cls))) for cls in event_types()}
    for value_type in KV_VALUES.values():
        files[f"jsonschema/{value_type.__name__}.json"] = _dump(json_schema(value_type, value_type.__name__))
    files["asyncapi.json"] = _dump(asyncapi())
    return files


def _existing(out_dir: Path) -> set[str]:
    """Generated-looking files on disk: the two folders this module owns, JSON only."""
    paths = [*out_dir.glob("*.json"), *out_dir.glob("jsonschema/*.json")]
    return {p.relative_to(out_dir).as_posix() for p in paths}


def check(out_dir: Path = GENERATED_DIR) -> list[str]:
    """What differs between the files in ``out_dir`` and what the code generates; empty if none."""
    expected = render()
    problems = []
    for path in sorted(expected.keys() | _existing(out_dir)):
        file = out_dir / path
        if path not in expected:
            problems.append(f"extra (no type generates it): {path}")
        elif not file.exists():
            problems.append(f"missing: {path}")
        elif file.read_text(encoding="utf-8") != expected[path]:
            problems.append(f"drifted: {path}")
    return problems


def write(out_dir: Path = GENERATED_DIR) -> list[str]:
    """Write every file and remove stale ones (a retired event); returns the paths written."""
    files = render()
    for stale in _existing(out_dir) - files.keys():
        (out_dir / stale).unlink()
    for path, text in files.items():
        (out_dir / path).parent.mkdir(parents=True, exist_ok=True)
        (out_dir / path).write_text(text, encoding="utf-8")
    return sorted(files)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m artery.schemas.generate", description=__doc__)
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 on drift")
    parser.add_argument("--out", type=Path, default=GENERATED_DIR, help="output folder")
    args = parser.parse_args(argv)
    if args.check:
        problems = check(args.out)
        if problems:
            print(f"{args.out} does not match the schema code:", file=sys.stderr)
            for problem in problems:
                print(f"  {problem}", file=sys.stderr)
            print("Run `make schemas` (python -m artery.schemas.generate) and commit.", file=sys.stderr)
            return 1
        print(f"{args.out}: up to date")
        return 0
    written = write(args.out)
    print(f"wrote {len(written)} files under {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
