"""Settings from environment variables, validated at start.

Each service declares a msgspec Struct whose fields are its settings; every field has a default
and a description (``Annotated[..., msgspec.Meta(description=...)]``), which ``artery config``
prints as the configuration reference. A field ``batch_size`` of a struct read with prefix
``ARTERY_COLLECTOR_`` comes from ``ARTERY_COLLECTOR_BATCH_SIZE``. Connection settings shared by
every service use the prefix ``ARTERY_`` (``ARTERY_NATS_URL``, ``ARTERY_DATABASE_URL``).
"""

from __future__ import annotations

import os
import re
import typing
from collections.abc import Mapping
from typing import Annotated, TypeVar

import msgspec

from artery.shared.errors import ConfigError

S = TypeVar("S", bound=msgspec.Struct)
#: Where msgspec says the wrong value is: the field, which names the variable.
_AT_FIELD = re.compile(r" - at `\$\.(\w+)`$")


def doc(description: str, **constraints) -> msgspec.Meta:
    return msgspec.Meta(description=description, **constraints)


class CommonSettings(msgspec.Struct, kw_only=True, frozen=True):
    """Read with prefix ``ARTERY_``."""

    nats_url: Annotated[str, doc("NATS server URL(s), comma-separated")] = "nats://127.0.0.1:4222"
    nats_creds: Annotated[str | None, doc("path to a NATS credentials file")] = None
    database_url: Annotated[str | None, doc("PostgreSQL DSN (postgresql://...)")] = None
    log_level: Annotated[str, doc("debug, info, warning or error")] = "info"
    log_format: Annotated[str, doc("json (machines) or console (people)")] = "json"
    otel_endpoint: Annotated[str | None, doc("OTLP/HTTP endpoint for traces; unset = no export")] = None
    stream_replicas: Annotated[int, doc("replicas of each JetStream stream (3 on a cluster)", ge=1, le=5)] = 1
    max_payload_bytes: Annotated[int, doc("largest message a client may publish", ge=1024)] = 8 * 1024 * 1024


def load(cls: type[S], prefix: str, environ: Mapping[str, str] | None = None) -> S:
    """Build ``cls`` from ``<prefix><FIELD>`` variables; raise ConfigError naming what is wrong."""
    environ = os.environ if environ is None else environ
    raw: dict[str, str] = {}
    for field in msgspec.structs.fields(cls):
        key = f"{prefix}{field.name.upper()}"
        if key in environ and environ[key] != "":
            raw[field.name] = environ[key]
    try:
        # strict=False lets "8" become 8 and "true" become True, as environment values need.
        return msgspec.convert(raw, cls, strict=False)
    except msgspec.ValidationError as exc:
        # The variable, not the field: what the operator set. Its value is left out (a secret?).
        at = _AT_FIELD.search(str(exc))
        if at is None:
            raise ConfigError(f"invalid setting ({prefix}*): {exc}") from exc
        problem = str(exc)[: at.start()]
        raise ConfigError(f"invalid setting {prefix}{at.group(1).upper()}: {problem}") from exc


def describe(cls: type[msgspec.Struct], prefix: str) -> list[tuple[str, str, str]]:
    """(variable, default, description) for every field: the configuration reference."""
    hints = typing.get_type_hints(cls, include_extras=True)
    rows = []
    for field in msgspec.structs.fields(cls):
        metas = getattr(hints[field.name], "__metadata__", ())
        description = next((m.description for m in metas if isinstance(m, msgspec.Meta)), "")
        if field.default is not msgspec.NODEFAULT:
            default = repr(field.default)
        else:
            default = "(generated)" if field.default_factory is not msgspec.NODEFAULT else "(required)"
        rows.append((f"{prefix}{field.name.upper()}", default, description or ""))
    return rows
