"""Hypothesis strategies of hostile input for every subject a client may publish to, and for the
inference HTTP API (used by ``tests/test_fuzz.py``).

Each strategy draws a few small choices (a category, a field, a wrong value, a size) and builds
the bytes from them, so that huge inputs (10,000 nested lists, 10,000 messages, megabytes) cost
hypothesis nothing to generate. Every hostile item carries what a correct service must answer:
the dead-letter kinds it may be rejected with and a pattern its reason must match (or, for HTTP,
the statuses it may get).
"""

from __future__ import annotations

import copy
import json
import math
import os
from dataclasses import dataclass
from typing import Any

import msgspec
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from artery.schemas.training import MAX_GROUPS_PER_STEP
from artery.shared.codec import CONTENT_TYPES, JSON, MSGPACK, EventDecoder
from artery.shared.errors import InvalidMessage
from tests.factories import group

PROJECT, MODEL = "fz", "agent"
#: Valid names a publisher may use, for the good traffic.
GOOD_NAMES = [(PROJECT, MODEL), ("p-1", "m_2"), ("P" * 64, "z")]


@dataclass(frozen=True)
class Hostile:
    label: str  # the category, for counts and failure messages
    subject: str
    payload: bytes
    #: The ``Content-Type`` header; None: no header (the payload is then read as JSON).
    content_type: str | None
    #: Dead-letter kinds a correct service may use for it, and a pattern its reason must match.
    kinds: frozenset[str]
    reason: str
    #: Headers sent besides ``Content-Type`` and ``Nats-Msg-Id``.
    headers: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class HostileHttp:
    label: str
    method: str
    path: str
    body: bytes
    content_type: str
    statuses: frozenset[int]
    #: The ``error.code`` it must carry, when there is one to check.
    code: str | None = None
    #: Sent without ``Content-Length`` (chunked), so a limit must count what it reads.
    chunked: bool = False


#: ``make fuzz``: ``ARTERY_FUZZ_SCALE`` times as many examples, drawn from ``ARTERY_FUZZ_SEED``
#: (printed, so that a failure can be replayed); ``make test`` runs scale 1, seed 0, every time alike.
SCALE = max(1, int(os.environ.get("ARTERY_FUZZ_SCALE", "1")))
SEED = int(os.environ.get("ARTERY_FUZZ_SEED", "0"))


def collect(strategy: st.SearchStrategy, n: int, at: int) -> list:
    """``n`` examples of ``strategy`` (times ``SCALE``), the same on every run with the same
    ``SEED`` (a fixed seed, no example database)."""
    found: list = []

    @seed(at + SEED)
    @settings(
        max_examples=n * SCALE,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def draw(value):
        found.append(value)

    draw()
    return found


def encode(value: Any, content_type: str) -> bytes:
    return msgspec.msgpack.encode(value) if content_type == MSGPACK else msgspec.json.encode(value)


def set_path(document: Any, path: tuple, value: Any) -> Any:
    out = copy.deepcopy(document)
    target = out
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return out


def deep_bytes(content_type: str, depth: int, shape: str) -> bytes:
    """``depth`` nested lists (or objects), built as bytes: no encoder could recurse that far."""
    if content_type == MSGPACK:
        return (b"\x91" if shape == "list" else b"\x81\xa1a") * depth + b"\xc0"
    if shape == "list":
        return b"[" * depth + b"]" * depth
    return b'{"a":' * depth + b"null" + b"}" * depth


_SENTINEL = "@@SENTINEL@@"


def with_raw(document: Any, path: tuple, raw: bytes, content_type: str) -> bytes:
    """``document`` encoded with the bytes ``raw`` spliced in as the value at ``path``."""
    encoded = encode(set_path(document, path, _SENTINEL), content_type)
    return encoded.replace(encode(_SENTINEL, content_type), raw, 1)


# Bytes that are not UTF-8 (a lone byte, a truncated sequence, a surrogate, beyond U+10FFFF, an
# overlong encoding), each spliced into a string of an otherwise valid document.
BAD_UTF8 = [b"\xff", b"\xc3\x28", b"\xe2\x82", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xc0\xaf", b"\x80"]


def with_bad_utf8(document: Any, path: tuple, bad: bytes, content_type: str) -> bytes:
    marker = "MARKER"
    encoded = encode(set_path(document, path, marker), content_type)
    # Same length as the marker, so a msgpack string header stays right.
    return encoded.replace(marker.encode(), (bad + b"xxxxxx")[: len(marker)], 1)


def payload_of(content_types=(JSON, MSGPACK)):
    return st.sampled_from(list(content_types))


garbage_bytes = st.one_of(
    st.binary(max_size=512),
    st.text(max_size=200).map(str.encode),
    st.sampled_from([b"", b"null", b"[]", b"{}", b"0", b'"x"', b"\x00" * 64, b"\xc1", b"{" * 3]),
)

#: Header values no service accepts (what ``EventDecoder`` does with them: lower, cut at ";").
bad_content_types = st.one_of(
    st.sampled_from(["text/xml", "application/x-msgpack", "application/jsonx", "multipart/form-data", "*"]),
    st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=300),
).filter(lambda v: v.split(";")[0].strip().lower() not in CONTENT_TYPES)


# --------------------------------------------------------------------------- trajectory groups

TRAJ_SUBJECT = f"artery.traj.{PROJECT}.{MODEL}"


def base_group(project: str = PROJECT, model: str = MODEL, size: int = 2) -> dict:
    document = msgspec.to_builtins(group(project, model, size=size, seed=7))
    document["id"] = "fz-hostile"
    document["time"] = "2026-01-01T00:00:00Z"  # the same bytes on every run
    for trajectory in document["trajectories"]:
        trajectory.setdefault("metadata", {})
    return {"metrics": {}, "metadata": {}, **document}


_BASE = base_group()

# Wrong values per field, each one invalid whatever the encoding.
_WRONG: dict[tuple, list] = {
    ("id",): [None, 7, "", "x" * 129, [], {}, "a\x00b"],
    ("project",): ["", ".a", "..", "a b", "x" * 65, "é", 5, None, "*", ">", "a=2Eb"],
    ("model",): ["", "a.", ".", "x" * 65, 1.5, ["agent"]],
    ("step",): [-1, 2**31, "3", 1.5, [], 2**64 - 1],
    ("time",): ["yesterday", "2024-01-01T00:00:00", None, 0, "2024-13-01T00:00:00Z"],
    ("split",): ["", "a b", "x" * 33, 1, None],
    ("trajectories",): [[], {}, "x", None],
    ("trajectories", 0): [None, "x", [], 1, {}],
    ("trajectories", 0, "reward"): ["high", None, [], {}, True],
    ("trajectories", 0, "messages"): [[], None, "hi"],
    ("trajectories", 0, "messages", 0, "role"): ["robot", "", 1, None],
    ("trajectories", 0, "messages", 0, "content"): [1, {}, [{"type": "video"}], [1]],
    ("trajectories", 0, "messages", 2, "sample", "token_ids"): ["abc", [1.5], [None], [[1]]],
    ("trajectories", 0, "metrics"): [[], "x", {"a": "b"}, {"a": None}],
    ("trajectories", 0, "metadata"): [{"a": [1]}, {"a": {}}, []],
    ("trajectories", 0, "tools"): [[{"type": "function"}], [{"type": "x", "function": {"name": "f"}}], "t"],
    ("exceptions",): [{}, [1], [{"type": 1}]],
    ("reward",): ["ruler", [], {"ruler": 1}],
    ("event",): ["trajectory_group.v9", "", "TRAJECTORY_GROUP", "train.requested", "dead_letter", 5, None],
}
_VALIDATION = frozenset({"validation"})
_DECODE = frozenset({"decode"})
_DECODE_OR_VALIDATION = frozenset({"decode", "validation"})
_MSGSPEC_REASON = r"expected|invalid|missing|out of range|at `\$"


def _group_hostile(label, payload, content_type, kinds, reason, subject=TRAJ_SUBJECT, headers=()) -> Hostile:
    return Hostile(label, subject, payload, content_type, frozenset(kinds), reason, tuple(headers))


# What is stored must be exactly what was sent: values that could only be stored changed (token
# ids beyond 32 bits, rewards whose sums overflow, non-finite alternatives' logprobs) are refused.
_SAMPLE = ("trajectories", 0, "messages", 2, "sample")
_OUT_OF_BOUNDS: dict[tuple, list] = {
    (*_SAMPLE, "token_ids", 0): [-1, 2**31, 2**32, 2**64 - 1],
    (*_SAMPLE, "top_logprobs"): [[[{"token": "x", "logprob": -0.1, "token_id": -1}]]],
    ("trajectories", 0, "initial_policy_version"): [-1, 2**31],
}


def _out_of_bounds(path, value, content_type):
    return _wrong_type(path, value, content_type, label="out_of_bounds")


def _reward_out_of_range(value, content_type):
    return _group_hostile(
        "reward_out_of_range",
        encode(set_path(_BASE, ("trajectories", 1, "reward"), value), content_type),
        content_type,
        {"out_of_range"},
        r"reward .* beyond the limit",
    )


def _non_finite_alternative(value):
    alternatives = [[{"token": "x", "logprob": -0.5}, {"token": "y", "logprob": value}]]
    return _group_hostile(
        "non_finite",
        encode(set_path(_BASE, (*_SAMPLE, "top_logprobs"), alternatives), MSGPACK),
        MSGPACK,
        {"non_finite"},
        r"top_logprobs",
    )


def _non_finite_in_history(value, field):
    """An additional history's samples are stored beside the trajectory's: checked alike."""
    sample = {"token_ids": [1], "logprobs": [-0.5]}
    if field == "logprobs":
        sample["logprobs"] = [value]
    else:
        sample["top_logprobs"] = [[{"token": "x", "logprob": value}]]
    history = {"messages": [{"role": "assistant", "content": "x", "sample": sample}]}
    return _group_hostile(
        "non_finite",
        encode(set_path(_BASE, ("trajectories", 0, "additional_histories"), [history]), MSGPACK),
        MSGPACK,
        {"non_finite"},
        rf"additional_histories\[0\]\.messages\[0\]\.sample\.{field}",
    )


def _untagged(content_type):
    document = {k: v for k, v in _BASE.items() if k != "event"}
    return _group_hostile(
        "untagged", encode(document, content_type), content_type, _VALIDATION, r"missing.*`event`"
    )


def _another_event(content_type):
    request = {"event": "train.requested", "id": "fz-req", "project": PROJECT, "model": MODEL}
    return _group_hostile(
        "another_event",
        encode({**request, "group_ids": ["g"]}, content_type),
        content_type,
        {"wrong_event"},
        r"not a trajectory group",
    )


def _contradicting_header(header, content_type):
    return _group_hostile(
        "header_mismatch",
        encode(_BASE, content_type),
        content_type,
        {"header_mismatch"},
        header[0],
        headers=[header],
    )


def _wrong_type(path, value, content_type, label="wrong_type"):
    return _group_hostile(
        label,
        encode(set_path(_BASE, path, value), content_type),
        content_type,
        _VALIDATION,
        _MSGSPEC_REASON,
    )


def _non_finite(path, value):
    return _group_hostile(
        "non_finite",
        encode(set_path(_BASE, path, value), MSGPACK),
        MSGPACK,
        {"non_finite"},
        r"nan|inf|non-finite",
    )


def _json_non_finite(literal: bytes):
    payload = with_raw(_BASE, ("trajectories", 1, "reward"), literal, JSON)
    if literal.lstrip(b"-") in (b"NaN", b"Infinity"):  # what json.dumps writes: named for what it is
        return _group_hostile("non_finite", payload, JSON, {"non_finite"}, r"NaN|Infinity")
    return _group_hostile("non_finite", payload, JSON, {"decode", "validation"}, r"malformed|out of range")


def _truncated(content_type, fraction):
    full = encode(_BASE, content_type)
    return _group_hostile(
        "truncated", full[: int(len(full) * fraction)], content_type, _DECODE_OR_VALIDATION, r"."
    )


def _deep(content_type, depth, where, shape):
    path = {
        "unknown_field": ("x",),
        "tool_parameters": ("trajectories", 0, "tools"),
        "unknown_object": ("unknown", "deeper"),
    }[where]
    document = _BASE
    if where == "tool_parameters":
        document = set_path(_BASE, path, [{"type": "function", "function": {"name": "f", "parameters": {}}}])
        path = (*path, 0, "function", "parameters", "p")
    elif where == "unknown_object":
        document = set_path(_BASE, ("unknown",), {})
    payload = with_raw(document, path, deep_bytes(content_type, depth, shape), content_type)
    return _group_hostile("deep_nesting", payload, content_type, _DECODE, r"nest|deep|recurs")


def _bad_utf8(content_type, bad, where):
    path = {
        "content": ("trajectories", 0, "messages", 0, "content"),
        "metadata_key": ("metadata",),
        "id": ("id",),
        # Unknown fields: a typed decode skips them unread, so only a check of the whole
        # message refuses them (a trajectory was stored with such a key, its reward as 0.0).
        "unknown_key": ("MARKER",),
        "unknown_value": ("unknown",),
    }[where]
    document = {"metadata_key": set_path(_BASE, path, {"MARKER": 1}), "unknown_key": set_path(_BASE, path, 1)}
    document = document.get(where, _BASE)
    if where in ("metadata_key", "unknown_key"):
        encoded = encode(document, content_type)
        payload = encoded.replace(b"MARKER", (bad + b"xxxxxx")[:6], 1)
    else:
        payload = with_bad_utf8(document, path, bad, content_type)
    return _group_hostile("bad_utf8", payload, content_type, _DECODE, r"utf-?8|unicode")


def _bad_content_type(value, content_type):
    return _group_hostile(
        "content_type", encode(_BASE, content_type), value, {"content_type"}, r"content type"
    )


def _swapped_content_type(content_type):
    other = MSGPACK if content_type == JSON else JSON
    return _group_hostile("content_type", encode(_BASE, content_type), other, _DECODE_OR_VALIDATION, r".")


def _bad_subject(subject, content_type):
    return _group_hostile(
        "bad_subject",
        encode(_BASE, content_type),
        content_type,
        {"subject_mismatch"},
        r"published on",
        subject,
    )


def _too_many(n):
    document = set_path(_BASE, ("trajectories",), [{"messages": [{"role": "user"}]}] * n)
    return _group_hostile(
        "too_many_trajectories", encode(document, JSON), JSON, {"too_large"}, r"trajectories is more than"
    )


def _too_large(max_bytes, extra, content_type):
    document = set_path(_BASE, ("trajectories", 0, "messages", 0, "content"), "x" * (max_bytes + extra))
    return _group_hostile("too_large", encode(document, content_type), content_type, {"too_large"}, r"limit")


def _bad_time(value):
    return _group_hostile(
        "bad_time",
        encode(set_path(_BASE, ("time",), value), JSON),
        JSON,
        {"validation", "storage"},
        r"time|date",
    )


def _sample_mismatch(cut, content_type):
    path = ("trajectories", 0, "messages", 2, "sample", "logprobs")
    logprobs = _BASE["trajectories"][0]["messages"][2]["sample"]["logprobs"]
    document = set_path(_BASE, path, logprobs[:cut])
    return _group_hostile(
        "sample_mismatch", encode(document, content_type), content_type, _VALIDATION, r"token ids but"
    )


_token = st.text(st.sampled_from("abcxyzAZ019_-éü$#%~"), min_size=1, max_size=70)
bad_trajectory_subjects = st.one_of(
    st.sampled_from(
        [
            "artery.traj.fz",
            "artery.traj.fz.agent.extra",
            "artery.traj.fz.other",
            "artery.traj.other.agent",
            "artery.traj." + "p" * 65 + ".agent",
            "artery.traj.é.agent",
            "artery.traj.fz.agent-2",
        ]
    ),
    st.lists(_token, min_size=1, max_size=4).map(lambda tokens: "artery.traj." + ".".join(tokens)),
).filter(lambda s: s != TRAJ_SUBJECT)


def hostile_groups(max_bytes: int) -> st.SearchStrategy[Hostile]:
    """Hostile ``artery.traj.*`` messages, with a collector limit of ``max_bytes`` per group."""
    wrong = st.sampled_from(sorted(_WRONG, key=str)).flatmap(
        lambda path: st.builds(_wrong_type, st.just(path), st.sampled_from(_WRONG[path]), payload_of())
    )
    non_finite_paths = [
        ("trajectories", 0, "reward"),
        ("trajectories", 1, "reward"),
        ("trajectories", 0, "metrics", "m"),
        ("metrics", "m"),
        ("trajectories", 0, "metadata", "m"),
        ("metadata", "m"),
        ("trajectories", 0, "messages", 2, "sample", "logprobs", 0),
        ("trajectories", 1, "messages", 4, "sample", "logprobs", 3),
    ]
    categories = [
        st.builds(
            lambda data, ct: _group_hostile("garbage", data, ct, _DECODE_OR_VALIDATION, r"."),
            garbage_bytes,
            st.sampled_from([JSON, MSGPACK, None]),
        ),
        st.builds(_truncated, payload_of(), st.floats(0, 0.999)),
        st.builds(
            _bad_utf8,
            payload_of(),
            st.sampled_from(BAD_UTF8),
            st.sampled_from(["content", "id", "metadata_key", "unknown_key", "unknown_value"]),
        ),
        wrong,
        st.builds(
            _non_finite, st.sampled_from(non_finite_paths), st.sampled_from([math.nan, math.inf, -math.inf])
        ),
        st.builds(
            _json_non_finite, st.sampled_from([b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-1e400"])
        ),
        st.builds(
            _deep,
            payload_of(),
            st.sampled_from([5_000, 10_000, 100_000]),
            st.sampled_from(["unknown_field", "tool_parameters", "unknown_object"]),
            st.sampled_from(["list", "object"]),
        ),
        st.builds(_bad_content_type, bad_content_types, payload_of()),
        st.builds(_swapped_content_type, payload_of()),
        st.builds(_bad_subject, bad_trajectory_subjects, payload_of()),
        st.builds(
            _bad_time,
            st.sampled_from(
                [
                    "0001-01-01T00:00:00+23:59",
                    "0001-01-01T00:30:00+01:00",
                    "9999-12-31T23:59:59-23:59",
                    "9999-12-31T23:00:00-01:00",
                    # Valid in UTC, but -infinity/infinity once stored, or just outside the
                    # collector's range (``validate.EARLIEST_TIME``, ``LATEST_TIME``).
                    "0001-01-01T00:00:00Z",
                    "9999-12-31T23:59:59.999999Z",
                    "1969-12-31T23:59:59Z",
                    "2100-01-01T00:00:00Z",
                ]
            ),
        ),
        st.builds(_sample_mismatch, st.integers(0, 11), payload_of()),
        st.sampled_from(sorted(_OUT_OF_BOUNDS, key=str)).flatmap(
            lambda path: st.builds(
                _out_of_bounds, st.just(path), st.sampled_from(_OUT_OF_BOUNDS[path]), payload_of()
            )
        ),
        st.builds(_reward_out_of_range, st.sampled_from([1.7e308, -1.7e308, 1e7, -2e6]), payload_of()),
        st.builds(_non_finite_alternative, st.sampled_from([math.nan, math.inf, -math.inf])),
        st.builds(
            _non_finite_in_history,
            st.sampled_from([math.nan, math.inf, -math.inf]),
            st.sampled_from(["logprobs", "top_logprobs"]),
        ),
        st.builds(_untagged, payload_of()),
        st.builds(_another_event, payload_of()),
        st.builds(
            _contradicting_header,
            st.sampled_from(
                [
                    ("Artery-Event", "train.requested"),
                    ("Artery-Event", "trajectory_group.v9"),
                    ("Artery-Schema", "2"),
                    ("Artery-Schema", "0"),
                ]
            ),
            payload_of(),
        ),
    ]
    # Each category as likely as any other (``one_of`` favours the first ones).
    return st.sampled_from(categories).flatmap(lambda category: category)


def oversized_groups(max_bytes: int) -> list[Hostile]:
    """Too many trajectories, too many bytes: a few of each (megabytes each, so not drawn by hypothesis)."""
    return [
        *(_too_many(n) for n in (1025, 4000, 10_000)),
        *(_too_large(max_bytes, extra, ct) for extra, ct in ((1, JSON), (10_000, MSGPACK), (300_000, JSON))),
    ]


def big_but_valid_groups() -> list[tuple[str, Any]]:
    """Absurd but valid: stored like any other group (subject, event)."""
    from artery.schemas import Message, Trajectory, TrajectoryGroupSubmitted, new_event_id

    many = Trajectory(messages=[Message(role="user", content=f"m{i}") for i in range(10_000)], reward=1.0)
    long_text = Trajectory(
        messages=[Message(role="user", content="y" * 500_000)], reward=-1e6
    )  # the limit itself
    nested = Trajectory(
        messages=[Message(role="user", content="tools")],
        tools=[{"function": {"name": "f", "parameters": json.loads('{"a":' * 50 + "1" + "}" * 50)}}],
    )
    return [
        (
            TRAJ_SUBJECT,
            TrajectoryGroupSubmitted(id=new_event_id(), project=PROJECT, model=MODEL, trajectories=[t]),
        )
        for t in (many, long_text, msgspec.convert(msgspec.to_builtins(nested), Trajectory))
    ]


# --------------------------------------------------------------------------- train requests

TRAIN_SUBJECT = f"artery.train.requested.{PROJECT}.{MODEL}"
#: A project nobody registered: a well-formed request for it is dead-lettered as ``unknown_model``.
GHOST = "ghost"
_TRAIN = {
    "event": "train.requested",
    "id": "fz-train",
    "project": PROJECT,
    "model": MODEL,
    "group_ids": ["g1"],
}
_TRAIN_WRONG: dict[tuple, list] = {
    ("id",): [None, "", "x" * 129, 5, "a\x00b"],
    ("project",): ["", "..", "x" * 65, None],
    ("group_ids",): [[], "g1", None, [1], [""], ["x" * 129], ["a\x00"]],
    ("config",): ["fast", [], 1],
    ("config", "learning_rate"): [0, -1e-5, "fast", math.nan, None],
    ("config", "loss_fn"): ["sgd", "", 1],
    ("config", "kl_penalty_coef"): [-1.0, "x"],
    ("config", "grad_accumulation_sequences"): [0, -3, 1.5],
    ("config", "scale_rewards"): ["yes", 1],
    ("max_steps_off_policy",): ["x", 1.5],
    ("step",): [-1, 2**40],
    ("event",): ["train.completed", "train.requested.v2", "trajectory_group", "", 0],
}


def _train_doc() -> dict:
    return {**_TRAIN, "config": {"learning_rate": 1e-5}}


def _train_requests() -> st.SearchStrategy[Hostile]:
    def wrong(path, value, content_type):
        document = set_path(_train_doc(), path, value)
        return Hostile(
            "wrong_type",
            TRAIN_SUBJECT,
            encode(document, content_type),
            content_type,
            _VALIDATION,
            _MSGSPEC_REASON,
        )

    def unregistered(n_ids, content_type, loss_fn):
        # Well formed, for a model nobody registered (a huge request among them).
        document = {
            **_train_doc(),
            "project": GHOST,
            "group_ids": [f"group-{i:0>100}" for i in range(n_ids)],
            "config": {"loss_fn": loss_fn},
        }
        return Hostile(
            "unknown_model",
            f"artery.train.requested.{GHOST}.{MODEL}",
            encode(document, content_type),
            content_type,
            frozenset({"unknown_model"}),
            r"not registered",
        )

    def too_many_groups(content_type):
        ids = [f"group-{i}" for i in range(MAX_GROUPS_PER_STEP + 1)]
        document = {**_train_doc(), "group_ids": ids}
        payload = encode(document, content_type)
        return Hostile("too_many_groups", TRAIN_SUBJECT, payload, content_type, _VALIDATION, r"length <=")

    def truncated(content_type, fraction):
        full = encode(_train_doc(), content_type)
        payload = full[: int(len(full) * fraction)]
        return Hostile("truncated", TRAIN_SUBJECT, payload, content_type, _DECODE_OR_VALIDATION, r".")

    return st.one_of(
        st.builds(
            lambda data, ct: Hostile("garbage", TRAIN_SUBJECT, data, ct, _DECODE_OR_VALIDATION, r"."),
            garbage_bytes,
            st.sampled_from([JSON, MSGPACK, None]),
        ),
        st.builds(truncated, payload_of(), st.floats(0, 0.999)),
        st.sampled_from(sorted(_TRAIN_WRONG, key=str)).flatmap(
            lambda path: st.builds(wrong, st.just(path), st.sampled_from(_TRAIN_WRONG[path]), payload_of())
        ),
        st.builds(
            lambda ct, value: Hostile(
                "content_type",
                TRAIN_SUBJECT,
                encode(_train_doc(), value),
                ct,
                frozenset({"content_type"}),
                r"content type",
            ),
            bad_content_types,
            payload_of(),
        ),
        st.builds(
            unregistered, st.sampled_from([1, 2, 10_000]), payload_of(), st.sampled_from(["grpo", "ppo"])
        ),
        st.builds(too_many_groups, payload_of()),
        st.builds(
            lambda subject, ct: Hostile(
                "subject_mismatch",
                subject,
                encode(_train_doc(), ct),
                ct,
                frozenset({"subject_mismatch"}),
                r"requested on",
            ),
            st.lists(_token, min_size=2, max_size=2)
            .map(lambda names: "artery.train.requested." + ".".join(names))
            .filter(lambda subject: subject != TRAIN_SUBJECT),
            payload_of(),
        ),
    )


# --------------------------------------------------------------------------- control requests

PAUSE_SUBJECT = f"artery.control.inference.{PROJECT}.{MODEL}.pause"
RESUME_SUBJECT = f"artery.control.inference.{PROJECT}.{MODEL}.resume"
RETAIN_SUBJECT = f"artery.control.publisher.{PROJECT}.{MODEL}.retain"
_PAUSE = {
    "event": "control.pause",
    "id": "fz-pause",
    "project": PROJECT,
    "model": MODEL,
    "lease_id": "fz-lease",
    "lease_seconds": 30.0,
    "requested_by": "fuzz",
}
_RESUME = {k: v for k, v in _PAUSE.items() if k != "lease_seconds"} | {"event": "control.resume"}
_RETAIN = {
    "event": "checkpoint.retain",
    "id": "fz-retain",
    "project": PROJECT,
    "model": MODEL,
    "best_metric": None,
}
_CONTROL_WRONG: dict[str, dict[tuple, list]] = {
    "pause": {
        ("lease_seconds",): [0, -1, 3601, "x", None, math.nan, math.inf],
        ("lease_id",): ["", "x" * 129, 5, None],
        ("requested_by",): [5, None],
        ("project",): ["", "..", None],
        ("free_memory",): ["yes", 2],
        ("event",): ["control.resume", "control.pause_ack", "", 1],
    },
    "resume": {
        ("lease_id",): ["", "x" * 129, 5, None],
        ("requested_by",): [5, []],
        ("model",): ["x" * 65, None],
        ("event",): ["control.pause", "control.resume_ack", None],
    },
    "retain": {
        ("keep_latest",): [0, -1, 1_000_001, "2", None, 1.5],
        ("best_metric",): ["", "m" * 257, 5],
        ("best_mode",): ["avg", "", None],
        ("event",): ["checkpoint.retained", "checkpoint.saved", 3],
        ("id",): ["", None],
    },
}
_CONTROL_BASE = {"pause": _PAUSE, "resume": _RESUME, "retain": _RETAIN}
_CONTROL_SUBJECT = {"pause": PAUSE_SUBJECT, "resume": RESUME_SUBJECT, "retain": RETAIN_SUBJECT}


def _control_requests() -> st.SearchStrategy[Hostile]:
    """Hostile requests for a replica's pause/resume subjects and the publisher's retention one."""

    def wrong(action, path, value, content_type):
        document = set_path(_CONTROL_BASE[action], path, value)
        return Hostile(
            action,
            _CONTROL_SUBJECT[action],
            encode(document, content_type),
            content_type,
            _VALIDATION,
            _MSGSPEC_REASON,
        )

    def wrong_target(action, project, content_type):
        document = set_path(_CONTROL_BASE[action], ("project",), project)
        kind = "subject_mismatch" if action == "retain" else "wrong_target"
        return Hostile(
            action,
            _CONTROL_SUBJECT[action],
            encode(document, content_type),
            content_type,
            frozenset({kind}),
            r"other|requested on|not fz",
        )

    def other(action, data, content_type):
        return Hostile(action, _CONTROL_SUBJECT[action], data, content_type, _DECODE_OR_VALIDATION, r".")

    def bad_type(action, value):
        return Hostile(
            action,
            _CONTROL_SUBJECT[action],
            encode(_CONTROL_BASE[action], JSON),
            value,
            frozenset({"content_type"}),
            r"content type",
        )

    actions = st.sampled_from(["pause", "resume", "retain"])
    truncated = st.builds(
        lambda action, ct, f: other(action, encode(_CONTROL_BASE[action], ct)[: int(f * 60)], ct),
        actions,
        payload_of(),
        st.floats(0, 0.999),
    )
    return st.one_of(
        st.builds(other, actions, garbage_bytes, st.sampled_from([JSON, MSGPACK])),
        truncated,
        actions.flatmap(
            lambda action: st.sampled_from(sorted(_CONTROL_WRONG[action], key=str)).flatmap(
                lambda path: st.builds(
                    wrong,
                    st.just(action),
                    st.just(path),
                    st.sampled_from(_CONTROL_WRONG[action][path]),
                    payload_of(),
                )
            )
        ),
        st.builds(wrong_target, actions, st.sampled_from(["other", "fz2", "FZ"]), payload_of()),
        st.builds(bad_type, actions, bad_content_types),
    )


# --------------------------------------------------------------------------- HTTP requests

GOOD_CHAT = {"model": "fake", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}
_CHAT_WRONG: dict[tuple, list] = {
    ("messages",): [
        [],
        "hi",
        None,
        [{"role": "robot", "content": "x"}],
        [{"content": "x"}],
        [1],
        # Tool-call arguments are a JSON string, never an object.
        [
            {"role": "user", "content": "x"},
            {
                "role": "assistant",
                "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": {"a": 1}}}],
            },
        ],
    ],
    ("messages", 0, "content"): [5, {"text": "x"}, [{"type": "image_url", "image_url": {"url": "x"}}], [1]],
    ("messages", 0, "tool_calls"): [
        "x",
        [{"function": {}}],
        [{"type": "retrieval", "function": {"name": "f"}}],
    ],
    ("model",): [5, None, [], {"name": "fake"}],
    ("n",): [0, -1, 17, "2", 1.5, 2**70],
    ("temperature",): [-0.1, 2.1, "hot", [], 1e400],
    ("top_p",): [0, 1.5, -1, "x"],
    ("max_tokens",): [0, -5, 2**70, "10", 1.5],
    ("max_completion_tokens",): [0, -1, "x"],
    ("stop",): [[""], "", [1], ["a"] * 17, {"a": 1}],
    ("seed",): ["x", 1.5, 2**70, -(2**64)],
    ("tools",): [
        "x",
        [{"type": "function"}],
        [{"type": "function", "function": {"name": ""}}],
        [{"type": "retrieval", "function": {"name": "f"}}],
        [{"type": "function", "function": {"name": "f", "parameters": "not an object"}}],
        [{"type": "function", "function": {"name": "f", "parameters": [1]}}],
        [{"type": "function", "function": {"name": 5}}],
        [None],
    ],
    ("tool_choice",): ["always", {"type": "function", "function": {"name": "missing"}}, "required", 5],
    ("logprobs",): ["yes", 2],
    ("top_logprobs",): [21, -1, 5, "x"],
    ("stream",): ["yes", 2],
    ("stream_options",): ["x", {"include_usage": "yes"}],
    ("chat_template_kwargs",): ["x", [1], {"tools": 1}],
    # OpenAI's ranges: a bias of -100..100 on a token id, penalties of -2..2, its formats.
    ("logit_bias",): [{"5": 1e308}, {"5": -101}, {"x": 1}, {"-1": 1}, {"99999999999": 1}, [1]],
    ("frequency_penalty",): [1e308, -2.5, 3, "x"],
    ("presence_penalty",): [-1e308, 2.01],
    ("response_format",): [
        "json",
        {"type": "xml"},
        {"type": "json_schema"},
        {"type": "json_schema", "json_schema": {}},
        5,
    ],
}
_ERROR_400 = frozenset({400})
#: The fuzzed app's body limit (``create_app(max_body_bytes=...)``): larger bodies get a 413.
HTTP_MAX_BODY = 64 * 1024


def _http_requests(max_context: int) -> st.SearchStrategy[HostileHttp]:
    def post(label, body, statuses=_ERROR_400, code=None, content_type="application/json"):
        return HostileHttp(
            label, "POST", "/v1/chat/completions", body, content_type, frozenset(statuses), code
        )

    def wrong(path, value, stream):
        document = set_path({**GOOD_CHAT, "stream": stream}, path, value)
        return post("wrong_type", json.dumps(document).encode())

    def unknown_model(name, stream):
        return post(
            "unknown_model",
            msgspec.json.encode({**GOOD_CHAT, "model": name, "stream": stream}),
            {404},
            "model_not_found",
        )

    def giant(size, as_parts):
        content: Any = "x" * size
        if as_parts:
            content = [{"type": "text", "text": "x" * (size // 2)}] * 2
        document = {**GOOD_CHAT, "messages": [{"role": "user", "content": content}]}
        del document["max_tokens"]
        body = msgspec.json.encode(document)
        if len(body) > HTTP_MAX_BODY:
            return post("giant_messages", body, {413}, code="request_too_large")
        return post("giant_messages", body, code="context_length_exceeded")

    def oversized(size, declared):
        # Refused before it is read, whatever it holds; chunked (no Content-Length) as well.
        body = b"x" * size
        return HostileHttp(
            "oversized",
            "POST",
            "/v1/chat/completions",
            body,
            "application/json",
            frozenset({413}),
            "request_too_large",
            chunked=not declared,
        )

    def huge_max_tokens(value, name):
        return post(
            "huge_max_tokens", msgspec.json.encode({**GOOD_CHAT, name: value}), code="context_length_exceeded"
        )

    def truncated(fraction, content_type):
        full = msgspec.json.encode({**GOOD_CHAT, "tools": [{"function": {"name": "f"}}]})
        return post("truncated", full[: int(len(full) * fraction)], content_type=content_type)

    def wrong_place(method, path):
        statuses = {404, 405}
        return HostileHttp(
            "wrong_route",
            method,
            path,
            msgspec.json.encode(GOOD_CHAT),
            "application/json",
            frozenset(statuses),
        )

    def any_value(field, value, stream):
        # Any JSON at all in any field: valid or not, never a server error.
        document = {**GOOD_CHAT, "stream": stream, field: value}
        return post("any_json", json.dumps(document).encode(), {200, 400, 404})

    json_values = st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
        lambda children: (
            st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
        ),
        max_leaves=12,
    )
    fields = sorted({path[0] for path in _CHAT_WRONG})
    served = {"fake", "fake@0"}
    return st.one_of(
        st.builds(any_value, st.sampled_from(fields), json_values, st.booleans()),
        st.builds(
            lambda body, ct: post("garbage", body, content_type=ct),
            garbage_bytes,
            st.sampled_from(["application/json", "text/plain", "application/msgpack", ""]),
        ),
        st.builds(truncated, st.floats(0, 0.999), st.sampled_from(["application/json", "text/xml"])),
        st.sampled_from(sorted(_CHAT_WRONG, key=str)).flatmap(
            lambda path: st.builds(wrong, st.just(path), st.sampled_from(_CHAT_WRONG[path]), st.booleans())
        ),
        st.builds(unknown_model, st.text(max_size=80).filter(lambda s: s not in served), st.booleans()),
        st.builds(giant, st.integers(max_context + 1, 300_000), st.booleans()),
        st.builds(oversized, st.integers(HTTP_MAX_BODY + 1, 4 * HTTP_MAX_BODY), st.booleans()),
        st.builds(
            huge_max_tokens,
            st.integers(max_context, 2**62),
            st.sampled_from(["max_tokens", "max_completion_tokens"]),
        ),
        st.builds(
            wrong_place,
            st.sampled_from(["GET", "PUT", "DELETE"]),
            st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/nope", "/v2/chat/completions"]),
        ),
    )


# --------------------------------------------------------------------------- once the decoders are hardened

# Invalid UTF-8 and deep nesting make msgspec raise outside its DecodeError. The collector turns
# them into dead letters (``validate.py``); ``shared/codec.py`` (the trainer, the control servers)
# and ``chat.decode_request`` (HTTP) do not yet: see the xfail tests in ``test_fuzz.py``. Once they
# do, these probes notice and the fuzzing of those targets sends such input too.


def shared_decoder_hardened() -> bool:
    from artery.schemas import TrainRequested

    decoder = EventDecoder(TrainRequested)
    for payload in (b'{"id": "\xff"}', deep_bytes(JSON, 10_000, "list")):
        try:
            decoder.decode(payload)
        except InvalidMessage:
            continue
        except Exception:
            return False
    return True


def chat_decoder_hardened() -> bool:
    from artery.services.inference.chat import decode_request
    from artery.services.inference.openai_types import ApiError

    for payload in (b'{"model": "\xff"}', deep_bytes(JSON, 10_000, "list")):
        try:
            decode_request(payload)
        except ApiError:
            continue
        except Exception:
            return False
    return True


def _utf8_and_depth(document: dict, subject: str, label_path: tuple, **hostile) -> st.SearchStrategy[Hostile]:
    def bad_utf8(content_type, bad):
        payload = with_bad_utf8(document, label_path, bad, content_type)
        return Hostile(hostile["label"], subject, payload, content_type, _DECODE, r"utf-?8|unicode")

    def deep(content_type, depth, shape):
        payload = with_raw(document, ("x",), deep_bytes(content_type, depth, shape), content_type)
        return Hostile(hostile["label"], subject, payload, content_type, _DECODE, r"nest|deep|recurs")

    return st.one_of(
        st.builds(bad_utf8, payload_of(), st.sampled_from(BAD_UTF8)),
        st.builds(deep, payload_of(), st.sampled_from([5_000, 100_000]), st.sampled_from(["list", "object"])),
    )


def hostile_train_requests() -> st.SearchStrategy[Hostile]:
    core = _train_requests()
    if not shared_decoder_hardened():
        return core
    return st.one_of(
        core, _utf8_and_depth(_train_doc(), TRAIN_SUBJECT, ("group_ids", 0), label="undecodable")
    )


def hostile_control_requests() -> st.SearchStrategy[Hostile]:
    core = _control_requests()
    if not shared_decoder_hardened():
        return core
    return st.one_of(
        core,
        *(
            _utf8_and_depth(_CONTROL_BASE[action], _CONTROL_SUBJECT[action], ("id",), label=action)
            for action in ("pause", "resume", "retain")
        ),
    )


def hostile_http_requests(max_context: int) -> st.SearchStrategy[HostileHttp]:
    core = _http_requests(max_context)
    if not chat_decoder_hardened():
        return core

    def as_http(h: Hostile) -> HostileHttp:
        statuses = frozenset({413}) if len(h.payload) > HTTP_MAX_BODY else _ERROR_400
        return HostileHttp(
            "undecodable", "POST", "/v1/chat/completions", h.payload, "application/json", statuses
        )

    gaps = _utf8_and_depth(GOOD_CHAT, "", ("messages", 0, "content"), label="undecodable")
    return st.one_of(core, gaps.filter(lambda h: h.content_type == JSON).map(as_http))
