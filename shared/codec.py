"""Encoding on the wire: JSON by default (any language can publish it), msgpack on request.

The content type travels in the ``Content-Type`` header; a message without one is JSON.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, TypeVar

import msgspec

from artery.shared.errors import InvalidMessage

# The headers every event carries (``bus.event_headers`` sets them).
MSG_ID = "Nats-Msg-Id"
CONTENT_TYPE = "Content-Type"
SCHEMA_HEADER = "Artery-Schema"
EVENT_HEADER = "Artery-Event"

JSON = "application/json"
MSGPACK = "application/msgpack"
CONTENT_TYPES = (JSON, MSGPACK)

T = TypeVar("T")

_json_encoder = msgspec.json.Encoder()
_msgpack_encoder = msgspec.msgpack.Encoder()


def encode(value: Any, content_type: str = JSON) -> bytes:
    if content_type == MSGPACK:
        return _msgpack_encoder.encode(value)
    return _json_encoder.encode(value)


class EventDecoder:
    """A typed decoder for one event type or tagged union, for both content types."""

    def __init__(self, type_: Any):
        self.type = type_
        self._json = msgspec.json.Decoder(type_)
        self._msgpack = msgspec.msgpack.Decoder(type_)

    def decode(self, data: bytes, content_type: str | None = None) -> Any:
        content_type = (content_type or JSON).split(";")[0].strip().lower()
        if content_type not in CONTENT_TYPES:
            raise InvalidMessage("content_type", f"unsupported content type {content_type!r}")
        decoder = self._msgpack if content_type == MSGPACK else self._json
        try:
            return decoder.decode(data)
        except msgspec.ValidationError as exc:
            raise InvalidMessage("validation", str(exc)) from exc
        except msgspec.DecodeError as exc:
            raise InvalidMessage("decode", f"not valid {content_type}: {exc}") from exc
        # msgspec raises these outside DecodeError: invalid UTF-8 in a string, and nesting deeper
        # than the interpreter's recursion limit. Both are the sender's fault, not ours.
        except UnicodeDecodeError as exc:
            raise InvalidMessage("decode", f"not valid {content_type}: {exc}") from exc
        except RecursionError:
            raise InvalidMessage("decode", f"not valid {content_type}: nested too deeply") from None


def json_leaves(value: Any) -> Iterator[Any]:
    """Every value in a decoded JSON tree that is not an object or an array, however deep: a loop,
    not recursion, since msgspec decodes deeper nesting than Python's recursion limit."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, Mapping):
            pending.extend(item.values())
        elif isinstance(item, list | tuple):
            pending.extend(item)
        else:
            yield item
