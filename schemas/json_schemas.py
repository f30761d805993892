"""The wire types of this package, found from the code, and the JSON Schema of each (dev time).

``event_types`` finds every concrete event by its tag (a new event needs no edit here);
``json_schema`` is one type's JSON Schema 2020-12 document. ``generate`` writes them,
``asyncapi`` builds on them.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from typing import Any

import msgspec

import artery.schemas as package
from artery.schemas import (
    SCHEMA_VERSION,
    Event,
    ModelRecord,
    ReplicaInfo,
)
from artery.shared import subjects

#: The modules of this package that only generate documents (they read ``artery.shared``).
DEV_TIME_MODULES = frozenset({"generate", "json_schemas", "asyncapi"})
DIALECT = "https://json-schema.org/draft/2020-12/schema"
#: The value type of each key-value bucket, by bucket; each also gets a JSON Schema file.
KV_VALUES: dict[str, type] = {subjects.REPLICAS_BUCKET: ReplicaInfo, subjects.MODELS_BUCKET: ModelRecord}


# ---------------------------------------------------------------------------------------------
# Finding the types


def tag(cls: type[msgspec.Struct]) -> str:
    """The event's tag (the value of its ``event`` field)."""
    found = cls.__struct_config__.tag
    if not isinstance(found, str):
        raise TypeError(f"{cls.__name__} is not an event: it has no tag")
    return found


def event_types() -> list[type[Event]]:
    """Every concrete event of this package, by tag: new events are found without edits here."""
    # Import every module first, so an event is found even before __init__ exports it.
    for module in pkgutil.iter_modules(package.__path__):
        if module.name not in DEV_TIME_MODULES:
            importlib.import_module(f"{package.__name__}.{module.name}")
    found: set[type[Event]] = set()
    todo = [Event]
    while todo:
        for sub in todo.pop().__subclasses__():
            todo.append(sub)
            # Only tagged classes are concrete; events defined by tests elsewhere are not ours.
            if sub.__struct_config__.tag is not None and sub.__module__.startswith(f"{package.__name__}."):
                found.add(sub)
    events = sorted(found, key=tag)
    tags = [tag(cls) for cls in events]
    if len(set(tags)) != len(tags):
        raise RuntimeError(f"two events share a tag: {tags}")
    return events


def summary(cls: type[msgspec.Struct]) -> str:
    """The first paragraph of the class docstring, on one line."""
    doc = inspect.cleandoc(cls.__doc__ or "")
    return " ".join(doc.split("\n\n")[0].split()) or f"The `{tag(cls)}` event."


def tidy(node: Any) -> Any:
    """Dedent descriptions: msgspec's dedent leaves a docstring's body indented when its text
    starts on the opening line, as ours do."""
    if isinstance(node, dict):
        return {
            k: inspect.cleandoc(v) if k == "description" and isinstance(v, str) else tidy(v)
            for k, v in node.items()
        }
    if isinstance(node, list):
        return [tidy(v) for v in node]
    return node


# ---------------------------------------------------------------------------------------------
# JSON Schema, one file per type


def json_schema(cls: type, name: str) -> dict:
    schema = tidy(msgspec.json.schema(cls))  # {"$ref": "#/$defs/<cls>", "$defs": {...}}
    return {
        "$schema": DIALECT,
        "$id": f"urn:artery:schema:{SCHEMA_VERSION}:{name}",
        "title": cls.__name__,
        "description": summary(cls),
        **schema,
    }
