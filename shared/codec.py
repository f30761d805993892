"""Encoding on the wire: JSON by default (any language can publish it), msgpack on request.

The content type travels in the ``Content-Type`` header; a message without one is JSON.

Everything decoded from outside is checked first for two things msgspec lets through: objects
and arrays nested deeper than ``MAX_NESTING`` (msgspec decodes up to the interpreter's recursion
limit, and whatever renders or stores the value later, a chat template's ``tojson`` or a JSON
parser, may recurse past it), and strings that are not valid UTF-8 (msgspec skips an unknown
key and its value without reading them, so bytes that are not text were accepted there). Both
are ``InvalidMessage`` of kind ``decode`` (too deep: ``NestedTooDeeply``): a dead letter, never a
crash.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
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

#: How deep objects and arrays may nest in anything decoded from outside. A trajectory group's
#: own structure takes about ten levels; a tool's parameter schema or an agent's metadata rarely
#: a dozen more. Far below the interpreter's recursion limit (1000), with room for the frames of
#: whatever walks the value later.
MAX_NESTING = 128

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
        if content_type == MSGPACK:
            check_msgpack(data)
        else:
            check_json(data)
        decoder = self._msgpack if content_type == MSGPACK else self._json
        try:
            return decoder.decode(data)
        except msgspec.ValidationError as exc:
            raise InvalidMessage("validation", str(exc)) from exc
        except msgspec.DecodeError as exc:
            raise InvalidMessage("decode", f"not valid {content_type}: {exc}") from exc
        # msgspec raises these outside DecodeError: invalid UTF-8 in a string (before 0.23), and
        # nesting deeper than the interpreter's recursion limit. Both are the sender's fault.
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


# --------------------------------------------------------------------------- input limits


class NestedTooDeeply(InvalidMessage):
    """Objects and arrays (maps and arrays in msgpack) nest deeper than ``MAX_NESTING``."""

    def __init__(self, reason: str) -> None:
        super().__init__("decode", reason)


#: A JSON string literal (escapes included): its brackets are text, not nesting.
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
#: Objects and arrays alike become ``[``/``]`` (crossed brackets are malformed: the decoder's
#: to refuse), everything else goes.
_AS_BRACKETS = bytes.maketrans(b"{}", b"[]")
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")


def check_json(data: bytes | str, *, limit: int = MAX_NESTING) -> None:
    """Raises ``InvalidMessage`` for JSON text that is not UTF-8, or nests deeper than ``limit``."""
    if isinstance(data, bytes | bytearray | memoryview):
        try:
            bytes(data).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidMessage("decode", f"not valid UTF-8: {exc}") from None
    if json_nesting_exceeds(data, limit):
        raise NestedTooDeeply(f"objects and arrays nest deeper than the limit of {limit}")


def json_nesting_exceeds(data: bytes | str, limit: int = MAX_NESTING) -> bool:
    """Whether JSON text nests objects and arrays deeper than ``limit``, without parsing it.

    Strings are cut out and only the brackets kept (both at C speed); then each pass removes
    every empty ``[]``, one level of the innermost nesting, so what still holds a pair after
    ``limit`` passes nests deeper. Malformed text is left to the decoder to refuse, except a run
    of more than ``limit`` openers, which is too deep whatever follows.
    """
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
    if raw.count(b"[") + raw.count(b"{") <= limit:  # the usual case: too few brackets to matter
        return False
    brackets = _JSON_STRING.sub(b"", raw).translate(_AS_BRACKETS, _NOT_BRACKET)
    if brackets.count(b"[") <= limit:
        return False
    for _ in range(limit):
        shorter = brackets.replace(b"[]", b"")
        if not shorter:
            return False
        if len(shorter) == len(brackets):  # malformed: unbalanced brackets
            return b"[" * (limit + 1) in brackets
        brackets = shorter
    return b"[]" in brackets


def check_msgpack(data: bytes, *, limit: int = MAX_NESTING) -> None:
    """The msgpack counterpart of ``check_json``: every string UTF-8, nesting within ``limit``.

    Decoded once without a type (that reads every key and string, the ones a typed decode skips),
    then walked without recursion. What this decode refuses, the typed one would refuse too, or
    skip unread: msgspec 0.23 reports invalid UTF-8 as a ``DecodeError`` (earlier versions as a
    ``UnicodeDecodeError``), and a typed decode skips an unknown key's bytes, so letting a
    ``DecodeError`` through to it accepted text that is not UTF-8. A map key that cannot be a
    Python dict key (``TypeError``) is left to the typed decode.
    """
    try:
        value = msgspec.msgpack.decode(data)
    except UnicodeDecodeError as exc:
        raise InvalidMessage("decode", f"a string is not valid UTF-8: {exc}") from None
    except RecursionError:
        raise NestedTooDeeply(f"maps and arrays nest deeper than the limit of {limit}") from None
    except msgspec.DecodeError as exc:
        raise InvalidMessage("decode", f"not valid {MSGPACK}: {exc}") from None
    except (ValueError, TypeError):
        return
    if nesting_depth(value, limit) > limit:
        raise NestedTooDeeply(f"maps and arrays nest deeper than the limit of {limit}")


class _Identified(msgspec.Struct):
    id: str | None = None


_identified_json = msgspec.json.Decoder(_Identified)
_identified_msgpack = msgspec.msgpack.Decoder(_Identified)


def event_id(data: bytes, content_type: str | None = JSON) -> str | None:
    """The top-level ``id`` of a payload that was refused, for its dead letter; None when it has
    none that can be read. Agents send no ``Nats-Msg-Id`` (JetStream's de-duplication window is
    the stream's, so another tenant could squat an id), so this is how an operator finds which
    event a letter is about."""
    try:
        if content_type == MSGPACK:
            check_msgpack(data)
            return _identified_msgpack.decode(data).id
        check_json(data)
        return _identified_json.decode(data).id
    except (InvalidMessage, msgspec.DecodeError, ValueError, TypeError, RecursionError):
        return None


def nesting_depth(value: Any, limit: int = MAX_NESTING) -> int:
    """How deep dicts and lists nest in a decoded value (a scalar: 0), counted up to ``limit + 1``."""
    deepest = 0
    pending = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        children: Iterable[Any]
        if isinstance(item, Mapping):
            children = item.values()
        elif isinstance(item, list | tuple):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        if depth > limit:
            return depth
        pending.extend((child, depth + 1) for child in children if isinstance(child, Mapping | list | tuple))
    return deepest
