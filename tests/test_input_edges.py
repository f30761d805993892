"""The edges of input, against the real services: each test sends what a hostile client sent and
would have been served, stored or held forever before, and expects a clean refusal.

- nesting: a 10,000-deep JSON string in tool-call arguments was an HTTP 500 and a dropped
  connection (a RecursionError in ``shared/chat_template.py``); nesting past ``codec.MAX_NESTING``
  is a 400 from the replica and a dead letter from the collector;
- slow clients: partial headers, or a ``Content-Length`` and no body, are cut with 408 after
  ``ARTERY_HTTP_*_TIMEOUT_S``; connections past ``ARTERY_HTTP_MAX_CONNECTIONS`` get 503 at once;
  the metrics server (``/metrics``, ``/healthz``, ``/readyz``) cuts and caps them likewise;
- step names: ``agent@０``, ``agent@٠`` and ``agent@00`` are not ``agent@0``;
- ``/health`` without the key says how the replica is, not what it serves;
- a group time of year 1 or 9999-12-31 (stored as -infinity/infinity) is a dead letter naming it;
- invalid UTF-8 in an unknown key is a dead letter, not a stored trajectory.

A real inference replica process with the tiny model (``Stack``), a real nats-server, PostgreSQL
and the collector (in process, as its service runs it).
"""

from __future__ import annotations

import asyncio
import json

import httpx
import msgspec
import pytest

from artery.schemas import DeadLetter, Trajectory
from artery.services.trainer.staleness import sampled_step
from artery.shared import metrics as metrics_server
from artery.shared import subjects
from artery.shared.codec import JSON, MAX_NESTING, MSGPACK, encode, event_id
from artery.shared.control_client import live_replicas
from artery.shared.served_name import parse_served_name
from tests.factories import group
from tests.helpers import wait_for
from tests.test_inference_service import MODEL, PROJECT, start_replica

pytestmark = pytest.mark.timeout(240)

KEY = "edge-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
USER = [{"role": "user", "content": "count to three"}]
HEADER_TIMEOUT_S = 5
MAX_CONNECTIONS = 48


@pytest.fixture
async def replica(stack, js) -> str:
    """One replica with an API key and short slow-client limits; its base URL."""
    start_replica(
        stack,
        "edge",
        ARTERY_INFERENCE_API_KEY=KEY,
        ARTERY_HTTP_HEADER_TIMEOUT_S=str(HEADER_TIMEOUT_S),
        ARTERY_HTTP_BODY_TIMEOUT_S=str(HEADER_TIMEOUT_S),
        ARTERY_HTTP_MAX_CONNECTIONS=str(MAX_CONNECTIONS),
    )
    await asyncio.to_thread(stack.processes["edge"].wait_ready, 120)
    infos = await wait_for(lambda: live_replicas(js, PROJECT, MODEL), timeout=30)
    return infos[0].url


def completion(model: str = MODEL, messages: list | None = None, **extra) -> dict:
    return {"model": model, "messages": messages or USER, "max_tokens": 2, "temperature": 0, **extra}


def deep(depth: int) -> str:
    return "[" * depth + "]" * depth


# --------------------------------------------------------------------------- nesting


async def test_deep_nesting_is_a_400_from_the_replica_and_a_dead_letter_from_the_collector(
    replica, js, db, run_collector
):
    tool_turn = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep(10_000)}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
    ]
    async with httpx.AsyncClient(base_url=replica, headers=AUTH, timeout=60) as http:
        in_arguments = await http.post("/v1/chat/completions", json=completion(messages=tool_turn))
        assert in_arguments.status_code == 400, in_arguments.text[:300]
        error = in_arguments.json()["error"]
        assert "nest deeper" in error["message"] and error["type"] == "invalid_request_error"
        in_body = await http.post(
            "/v1/chat/completions",
            content=json.dumps(completion(padding=json.loads(deep(MAX_NESTING + 1)))).encode(),
            headers={"Content-Type": "application/json"},
        )
        assert in_body.status_code == 400 and in_body.json()["error"]["code"] == "nested_too_deeply"
        # Within the limit it is served, on the same client: the replica is none the worse.
        ok = await http.post(
            "/v1/chat/completions", json=completion(padding=json.loads(deep(MAX_NESTING - 2)))
        )
        assert ok.status_code == 200, ok.text[:300]

    await run_collector()
    deep_field = _document("deep_field")
    deep_field["x"] = json.loads(deep(MAX_NESTING + 1))
    deep_arguments = _document("deep_arguments")
    deep_arguments["trajectories"][0]["messages"][2]["tool_calls"] = [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep(10_000)}}
    ]
    letters = await _refused(
        js,
        db,
        {
            "deep_field": encode(deep_field),
            "deep_field_msgpack": encode(deep_field | {"id": "deep_field_msgpack"}, MSGPACK),
            "deep_arguments": encode(deep_arguments),
        },
    )
    assert letters["deep_field"].kind == letters["deep_field_msgpack"].kind == "decode"
    assert "nest deeper than the limit of 128" in letters["deep_field"].reason
    assert letters["deep_arguments"].kind == "validation"
    assert "trajectories[0].messages[2].tool_calls[0].function.arguments nests deeper" in (
        letters["deep_arguments"].reason
    )


# --------------------------------------------------------------------------- slow clients


async def test_slow_clients_are_cut_and_connections_past_the_cap_refused(replica):
    host, port = httpx.URL(replica).host, httpx.URL(replica).port
    partial_headers = b"GET /v1/models HTTP/1.1\r\nHost: replica\r\nAuthorization: Bea"
    no_body = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: replica\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {KEY}\r\nContent-Length: 1000\r\n\r\n".encode()
        + b'{"model": '
    )
    slow = []
    for i in range(MAX_CONNECTIONS):
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(no_body if i % 2 else partial_headers)
        await writer.drain()
        slow.append((reader, writer))
    # Accepted in order once the slow ones are in: every one past the cap is refused at once.
    extra = [await asyncio.open_connection(host, port) for _ in range(500 - MAX_CONNECTIONS)]
    try:
        refused = await asyncio.wait_for(asyncio.gather(*(reader.read() for reader, _ in extra)), 30)
        assert all(answer.startswith(b"HTTP/1.1 503 ") for answer in refused), {a[:20] for a in refused}
        # The slow ones are answered 408 and closed (read() returns at EOF) after their timeout.
        cut = await asyncio.wait_for(asyncio.gather(*(reader.read() for reader, _ in slow)), 30)
        assert all(answer.startswith(b"HTTP/1.1 408 ") for answer in cut), {a[:20] for a in cut}
    finally:
        for _, writer in slow + extra:
            writer.close()
    async with httpx.AsyncClient(base_url=replica, headers=AUTH, timeout=60) as http:
        assert (await http.get("/v1/models")).status_code == 200


async def test_the_metrics_server_cuts_slow_clients_and_caps_connections(replica, stack):
    metrics = httpx.URL(stack.processes["edge"].ready_info["metrics_url"])
    slow = []
    for _ in range(metrics_server.MAX_CONNECTIONS):
        reader, writer = await asyncio.open_connection(metrics.host, metrics.port)
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: replica\r\nAccept: tex")
        await writer.drain()
        slow.append((reader, writer))
    extra = [await asyncio.open_connection(metrics.host, metrics.port) for _ in range(20)]
    try:
        # Past the cap: closed unread, long before a served connection could time out.
        refused = await asyncio.wait_for(
            asyncio.gather(*(reader.read() for reader, _ in extra)), metrics_server.READ_TIMEOUT_S / 2
        )
        assert refused == [b""] * len(extra)
        cut = await asyncio.wait_for(asyncio.gather(*(reader.read() for reader, _ in slow)), 60)
        assert cut == [b""] * len(slow)
    finally:
        for _, writer in slow + extra:
            writer.close()
    async with httpx.AsyncClient(timeout=60) as http:
        assert (await http.get(str(metrics.copy_with(path="/healthz")))).status_code == 200


# --------------------------------------------------------------------------- step names


async def test_a_step_is_named_in_ascii_digits_only(replica):
    async with httpx.AsyncClient(base_url=replica, headers=AUTH, timeout=60) as http:
        served = [card["id"] for card in (await http.get("/v1/models")).json()["data"]]
        assert f"{MODEL}@0" in served
        answered = await http.post("/v1/chat/completions", json=completion(f"{MODEL}@0"))
        assert answered.status_code == 200 and answered.json()["model"] == f"{MODEL}@0"
        for alias in (f"{MODEL}@０", f"{MODEL}@٠", f"{MODEL}@00", f"{MODEL}@+0", f"{MODEL}@ 0"):
            refused = await http.post("/v1/chat/completions", json=completion(alias))
            assert refused.status_code == 404, (alias, refused.text[:200])
            assert refused.json()["error"]["code"] == "model_not_found"
    # The trainer reads a sample's step with the same parser: an alias is no step at all.
    for alias, step in ((f"{MODEL}@00", None), (f"{MODEL}@١٢", None), (f"{MODEL}@12", 12)):
        assert parse_served_name(alias) == (None if step is None else (MODEL, step))
        sample = {"token_ids": [1], "logprobs": [-0.5], "served_model": alias}
        trajectory = msgspec.convert(
            {"messages": [{"role": "assistant", "content": "x", "sample": sample}], "reward": 0.0}, Trajectory
        )
        assert sampled_step(trajectory, MODEL) == step


# --------------------------------------------------------------------------- health


async def test_health_without_the_key_says_nothing_of_adapters(replica):
    async with httpx.AsyncClient(base_url=replica, timeout=60) as http:
        probe = await http.get("/health")
        assert probe.status_code == 200 and probe.json() == {"status": "ok"}
        for path in ("/healthz", "/readyz"):
            answer = await http.get(path)
            assert answer.status_code == 200 and "adapters" not in answer.json(), path
        wrong = await http.get("/health", headers={"Authorization": "Bearer wrong"})
        assert wrong.json() == {"status": "ok"}
        assert (await http.get("/v1/models")).status_code == 401
        detailed = await http.get("/health", headers=AUTH)
        assert detailed.status_code == 200 and detailed.json() == {"status": "ok", "adapters": []}


# --------------------------------------------------------------------------- the collector


async def test_a_time_outside_the_sane_range_is_a_dead_letter_naming_it(js, db, run_collector):
    await run_collector()
    payloads = {}
    for label, time in (
        ("year_one", "0001-01-01T00:00:00Z"),
        ("last_microsecond", "9999-12-31T23:59:59.999999Z"),
        ("before_the_epoch", "1969-12-31T23:59:59Z"),
        ("year_2100", "2100-01-01T00:00:00+00:00"),
    ):
        payloads[label] = encode(_document(label) | {"time": time})
    letters = await _refused(js, db, payloads)
    for label, letter in letters.items():
        assert letter.kind == "validation" and letter.reason.startswith("time "), (label, letter.reason)
        assert letter.original_id == label


async def test_invalid_utf8_in_an_unknown_key_is_a_dead_letter(js, db, run_collector):
    await run_collector()
    marked = _document("utf8_json") | {"MARKER": 1}
    in_key = encode(marked).replace(b"MARKER", b"x\xffyyyy")
    marked_msgpack = _document("utf8_msgpack") | {"MARKER": 1}
    in_key_msgpack = encode(marked_msgpack, MSGPACK).replace(b"MARKER", b"x\xffyyyy")
    in_value = encode(_document("utf8_value") | {"unknown": "MARKER"}).replace(
        b"MARKER", b"\xc3(\xed\xa0\x80"
    )
    letters = await _refused(
        js, db, {"utf8_json": in_key, "utf8_msgpack": in_key_msgpack, "utf8_value": in_value}
    )
    for label, letter in letters.items():
        assert letter.kind == "decode" and "UTF-8" in letter.reason, (label, letter.reason)


# --------------------------------------------------------------------------- helpers


def _document(group_id: str) -> dict:
    """A valid group as JSON-ready builtins, with ``group_id`` as its id."""
    return msgspec.to_builtins(group(size=2)) | {"id": group_id}


async def _refused(js, db, payloads: dict[str, bytes]) -> dict[str, DeadLetter]:
    """Publish each payload (its label as message id), then a good group; once the good group is
    stored, one dead letter per payload: {label: letter}. None of them is stored."""
    subject = subjects.trajectories("demo", "agent")
    for label, payload in payloads.items():
        content_type = MSGPACK if label.endswith("msgpack") else JSON
        await js.publish(subject, payload, headers={"Content-Type": content_type, "Nats-Msg-Id": label})
    good = group(size=2, seed=7)
    await js.publish(subject, encode(good), headers={"Nats-Msg-Id": good.id})

    async def settled():
        stored = await db.fetchval("SELECT count(*) FROM trajectory_groups WHERE id = $1", good.id)
        letters = await _dead_letters(js)
        return letters if stored and len(letters) >= len(payloads) else None

    letters = await wait_for(settled, timeout=30)
    by_label = {letter.headers.get("Nats-Msg-Id"): letter for letter in letters}
    assert set(by_label) == set(payloads), by_label
    for label in payloads:
        stored = await db.fetchval("SELECT count(*) FROM trajectory_groups WHERE id = $1", label)
        assert stored == 0, label
    return by_label


async def _dead_letters(js) -> list[DeadLetter]:
    info = await js.stream_info(subjects.DLQ.name)
    letters = []
    for seq in range(max(info.state.first_seq, 1), info.state.last_seq + 1) if info.state.messages else ():
        message = await js.get_msg(subjects.DLQ.name, seq)
        letters.append(msgspec.json.decode(message.data, type=DeadLetter))
    return letters


def test_a_dead_letter_names_the_refused_events_id_read_from_its_payload():
    """Agents send no Nats-Msg-Id, so a letter finds the event's id in the payload when it can."""
    event = group(PROJECT, MODEL, size=1)
    assert event_id(encode(event), JSON) == event.id
    assert event_id(encode(event, MSGPACK), MSGPACK) == event.id
    assert event_id(b"[1, 2]", JSON) is None  # not an object: no id to tell
    assert event_id(b"{" * (MAX_NESTING + 1), JSON) is None  # too deep is not parsed at all
    assert event_id(b'{"id": "x", "k": "\xff"}', JSON) is None  # not UTF-8: refused unread
