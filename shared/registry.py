"""Reading the model registry (KV ``artery_models``, key ``<project>.<model>``) without trusting it.

Agents write their own models' records (``register()``), so a record may hold anything an agent
sent. Every reader goes through ``read_record``: a record that does not decode, or that names
another model than its key, counts as absent, with a warning naming the key; it never crashes a
reader or fails a request again and again.
"""

from __future__ import annotations

import msgspec
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

from artery.schemas import ModelRecord
from artery.shared import subjects
from artery.shared.logs import get_logger

log = get_logger(__name__)
_decoder = msgspec.json.Decoder(ModelRecord)


class RegistryEntry(msgspec.Struct, frozen=True):
    record: ModelRecord
    revision: int


def decode_record(project: str, model: str, value: bytes) -> ModelRecord | None:
    """The record stored under ``<project>.<model>``, or None (and a warning) when it is garbage."""
    key = subjects.model_key(project, model)
    try:
        record = _decoder.decode(value)
    except msgspec.DecodeError as exc:  # ValidationError included
        log.warning("invalid model record ignored", key=key, error=str(exc))
        return None
    if (record.project, record.name) != (project, model):
        log.warning(
            "model record ignored: it names another model", key=key, names=f"{record.project}.{record.name}"
        )
        return None
    return record


async def read_record(kv: KeyValue, project: str, model: str) -> RegistryEntry | None:
    """The model's valid record and its revision (for compare-and-set), or None."""
    try:
        entry = await kv.get(subjects.model_key(project, model))
    except KeyNotFoundError:  # never registered, or deleted
        return None
    record = decode_record(project, model, entry.value or b"")
    return None if record is None else RegistryEntry(record, entry.revision)
