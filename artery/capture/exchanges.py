"""``Trajectory.exchanges``: each model call a scope saw, as its raw request and native response."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any, Literal

#: The wire APIs a scope records, named as ``TrajectoryExchanges``' lists are.
Kind = Literal["chat_completions", "completions", "responses", "messages"]

#: A POST whose path ends so is that API's call (chat first: it also ends in ``/completions``).
_PATHS: tuple[tuple[str, Kind], ...] = (
    ("/chat/completions", "chat_completions"),
    ("/completions", "completions"),
    ("/responses", "responses"),
    ("/messages", "messages"),
)


def kind_of(method: str, path: str) -> Kind | None:
    if method.upper() != "POST":
        return None
    path = path.rstrip("/")
    for suffix, kind in _PATHS:
        if path.endswith(suffix):
            return kind
    return None


@dataclass
class Exchange:
    """One call: ``request`` is its JSON body; ``response`` the client library's own object
    (``openai`` / ``anthropic`` types when installed, else the JSON dict); ``model`` the name
    the server answered under (``<model>@<step>`` on Artery)."""

    request: dict[str, Any]
    response: Any
    model: str | None
    start_time: dt.datetime
    end_time: dt.datetime


@dataclass
class TrajectoryExchanges:
    chat_completions: list[Exchange] = field(default_factory=list)
    completions: list[Exchange] = field(default_factory=list)
    responses: list[Exchange] = field(default_factory=list)
    messages: list[Exchange] = field(default_factory=list)

    def add(self, kind: Kind, exchange: Exchange) -> None:
        getattr(self, kind).append(exchange)

    def in_order(self) -> list[tuple[Kind, Exchange]]:
        """Every exchange with its API, in the order the calls started."""
        kinds: tuple[Kind, ...] = ("chat_completions", "completions", "responses", "messages")
        every = [(kind, e) for kind in kinds for e in getattr(self, kind)]
        return sorted(every, key=lambda pair: pair[1].start_time)

    def __bool__(self) -> bool:
        return bool(self.chat_completions or self.completions or self.responses or self.messages)

    def __len__(self) -> int:
        return len(self.chat_completions) + len(self.completions) + len(self.responses) + len(self.messages)


def native_response(kind: Kind, data: dict[str, Any]) -> Any:
    """The response as the client library would have returned it; the dict when that library is
    not installed or the body does not fit its type. Extra fields (Artery's ``token_ids``...)
    stay, as the libraries keep unknown fields."""
    try:
        if kind == "chat_completions":
            from openai.types.chat import ChatCompletion as native
        elif kind == "completions":
            from openai.types import Completion as native  # type: ignore[assignment]
        elif kind == "responses":
            from openai.types.responses import Response as native  # type: ignore[assignment]
        else:
            from anthropic.types import Message as native  # type: ignore[assignment]
    except ImportError:
        return data
    try:
        return native.model_validate(data)
    except ValueError:  # pydantic's ValidationError
        return data


def as_data(response: Any) -> dict[str, Any]:
    """A response (native or dict) as a JSON dict, extra fields included."""
    if hasattr(response, "model_dump"):
        return response.model_dump(mode="json", exclude_none=True)
    return dict(response)
