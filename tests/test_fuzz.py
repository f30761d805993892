"""Property-based fuzzing of every subject a client may publish to, and of the inference HTTP API.

Hostile input is generated with hypothesis (fixed seeds, no example database: every run sends the
same bytes), published in one pipelined batch with good input interleaved, and then checked:

- streamed subjects (``artery.traj.*``, ``artery.train.requested.*``): every hostile message has
  exactly one dead letter whose kind and reason name the problem, every good one is stored (or
  answered) exactly once, no message is redelivered, and the service is still consuming;
- request/reply subjects (a replica's pause/resume, the publisher's retain): every hostile request
  is answered at once (with ``error`` where the reply has one) and dead-lettered once;
- HTTP: every hostile request gets a 4xx with an OpenAI-shaped error body, and good requests
  interleaved with them succeed.

The tests at the end pin what fuzzing found in shared code (``shared/codec.py``,
``services/inference/chat.py``, ``services/inference/control.py``): invalid UTF-8 and absurd
nesting raised outside msgspec's DecodeError, and a lease id the error ack could not carry.
"""

from __future__ import annotations

import asyncio
import collections
import re

import httpx
import msgspec
import pytest
from nats.errors import MaxPayloadError, NoRespondersError

from artery.schemas import (
    DeadLetter,
    PauseAck,
    ResumeAck,
    RetentionApplied,
    TrainRequested,
    Trajectory,
    TrajectoryGroupSubmitted,
    new_event_id,
)
from artery.services.inference.api import create_app
from artery.services.inference.control import ControlServer
from artery.services.inference.pause import PauseGate
from artery.services.inference.serving import ServingState
from artery.services.publisher.control import RetentionServer
from artery.services.publisher.service import Publisher
from artery.services.publisher.settings import PublisherSettings
from artery.shared import bus, subjects
from artery.shared.bus import CONTENT_TYPE, MSG_ID
from artery.shared.codec import JSON, MSGPACK, EventDecoder, encode
from artery.shared.errors import InvalidMessage
from tests import strategies as fz
from tests.factories import group, register_trainable
from tests.helpers import FakeEngine, wait_for

pytestmark = pytest.mark.slow

MAX_GROUP_BYTES = 1024 * 1024
COLLECTOR_DLQ_PAYLOAD = 64 * 1024
CONTROL_DLQ_PAYLOAD = 16 * 1024


def _headers(content_type: str | None, msg_id: str | None, extra=()) -> dict[str, str]:
    headers = dict(extra)
    if content_type is not None:
        headers[CONTENT_TYPE] = content_type
    if msg_id is not None:
        headers[MSG_ID] = msg_id
    return headers


async def _letters(js, service: str) -> list[DeadLetter]:
    """Every dead letter of ``service``, decoded with the schema (so an invalid one fails here)."""
    info = await js.stream_info(subjects.DLQ.name)
    found = []
    if not info.state.messages:
        return []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        msg = await js.get_msg(subjects.DLQ.name, seq)
        if msg.subject == subjects.dead_letter(service):
            found.append(msg.data)
    return [msgspec.json.decode(data, type=DeadLetter) for data in found]


async def _on_subject(js, stream: str, subject: str) -> int:
    info = await js.stream_info(stream, subjects_filter=subject)
    return (info.state.subjects or {}).get(subject, 0)


def _check_letter(letter: DeadLetter, hostile: fz.Hostile, service: str, problems: list[str]) -> None:
    where = f"{hostile.label} {hostile.payload[:80]!r} ({hostile.content_type})"
    if letter.kind not in hostile.kinds:
        problems.append(
            f"{where}: kind {letter.kind!r}, expected one of {sorted(hostile.kinds)}: {letter.reason}"
        )
    elif not re.search(hostile.reason, letter.reason, re.IGNORECASE):
        problems.append(f"{where}: reason {letter.reason!r} does not match {hostile.reason!r}")
    if letter.service != service or letter.subject != hostile.subject:
        problems.append(f"{where}: letter for {letter.service} on {letter.subject}")
    if letter.content_type != hostile.content_type:
        problems.append(f"{where}: content type {letter.content_type!r} recorded")


def _summary(problems: list[str]) -> str:
    return f"{len(problems)} problems:\n" + "\n".join(problems[:15])


# --------------------------------------------------------------------------- the collector


def _good_groups() -> list[tuple[str, bytes, str | None, TrajectoryGroupSubmitted]]:
    """Valid groups in every accepted shape: both encodings, content types with parameters or
    none, every valid name form, absurd-but-valid sizes and values (a sampled U+0000, token ids
    at 2^31 - 1), and ids another tenant uses too."""
    shapes = [JSON, MSGPACK, "application/json; charset=utf-8", "APPLICATION/MSGPACK", None]
    good = []
    for i in range(80):
        project, model = fz.GOOD_NAMES[i % len(fz.GOOD_NAMES)]
        g = group(project, model, size=1 + i % 3, seed=1000 + i)
        if i % 10 == 1:  # the previous group's id, in another tenant: both are stored
            g.id = good[-1][3].id
        if i % 10 == 2:
            g.trajectories[0].messages[2].content = "a\x00b"
            g.trajectories[0].messages[2].sample.token_ids[0] = 2**31 - 1
        content_type = shapes[i % len(shapes)]
        wire = MSGPACK if content_type and "msgpack" in content_type.lower() else JSON
        good.append((subjects.trajectories(project, model), encode(g, wire), content_type, g))
    for subject, g in fz.big_but_valid_groups():
        good.append((subject, encode(g, MSGPACK), MSGPACK, g))
    return good


@pytest.mark.timeout(180 * fz.SCALE)
async def test_collector_dead_letters_every_hostile_group_while_good_ones_flow(
    js, db, run_collector, common_settings
):
    hostile: list[fz.Hostile] = fz.collect(fz.hostile_groups(MAX_GROUP_BYTES), 700, at=20260101)
    near_max = common_settings.max_payload_bytes - 64 * 1024  # room left for the headers
    hostile += fz.oversized_groups(MAX_GROUP_BYTES)
    hostile += [
        fz.Hostile(
            "near_max_payload", fz.TRAJ_SUBJECT, b"{" * near_max, JSON, frozenset({"too_large"}), "limit"
        ),
        fz.Hostile(
            "near_max_payload",
            fz.TRAJ_SUBJECT,
            b"\x00" * near_max,
            MSGPACK,
            frozenset({"too_large"}),
            "limit",
        ),
    ]
    good = _good_groups()
    collectors = [await run_collector(max_group_bytes=MAX_GROUP_BYTES)]

    # Beyond the server's max_payload: the client refuses it before anything is sent.
    with pytest.raises(MaxPayloadError):
        await js.publish(fz.TRAJ_SUBJECT, b"x" * (common_settings.max_payload_bytes + 1))

    # One pipelined batch: a good group after every few hostile ones; some good groups again
    # under another Nats-Msg-Id (past JetStream's de-duplication: PostgreSQL must drop them).
    outgoing: list[tuple[str, bytes, dict, fz.Hostile | None]] = []
    good_iter = iter(good)
    for i, h in enumerate(hostile):
        msg_id = None if i % 11 == 0 else f"fz-bad-{i}"  # some without any Nats-Msg-Id
        outgoing.append((h.subject, h.payload, _headers(h.content_type, msg_id, h.headers), h))
        if i % 8 == 0 and (item := next(good_iter, None)) is not None:
            subject, payload, content_type, g = item
            outgoing.append((subject, payload, _headers(content_type, bus.tenant_msg_id(g)), None))
            if i % 40 == 0:
                outgoing.append((subject, payload, _headers(content_type, f"again-{g.id}"), None))
    for subject, payload, content_type, g in good_iter:
        outgoing.append((subject, payload, _headers(content_type, bus.tenant_msg_id(g)), None))
    futures = [await js.publish_async(s, p, headers=h) for s, p, h, _ in outgoing]
    acks = await asyncio.gather(*futures)
    by_seq = {ack.seq: h for ack, (_, _, _, h) in zip(acks, outgoing, strict=True) if h is not None}
    assert len(by_seq) == len(hostile)  # no hostile message was de-duplicated away by JetStream

    good_keys = {(g.project, g.model, g.id) for *_, g in good}
    n_trajectories = sum(len(g.trajectories) for *_, g in good)

    async def settled():
        dead = (await js.stream_info(subjects.DLQ.name)).state.messages
        stored = await db.fetchval("SELECT count(*) FROM trajectory_groups")
        ci = await js.consumer_info(subjects.TRAJECTORIES.name, subjects.COLLECTOR_CONSUMER)
        return dead >= len(hostile) and stored >= len(good_keys) and ci.num_pending + ci.num_ack_pending == 0

    await wait_for(settled, timeout=90 * fz.SCALE, interval=0.2)

    letters = await _letters(js, "collector")
    assert len(letters) == len(hostile), [
        (lt.kind, lt.reason) for lt in letters if lt.stream_seq not in by_seq
    ]
    problems: list[str] = []
    seen = collections.Counter(letter.stream_seq for letter in letters)
    assert set(seen) == set(by_seq) and max(seen.values()) == 1
    for letter in letters:
        h = by_seq[letter.stream_seq]
        _check_letter(letter, h, "collector", problems)
        if letter.payload != h.payload[:COLLECTOR_DLQ_PAYLOAD] or letter.payload_truncated != (
            len(h.payload) > COLLECTOR_DLQ_PAYLOAD
        ):
            problems.append(f"{h.label}: payload not kept")
    assert not problems, _summary(problems)

    # Good groups: all stored, exactly once, whole, exactly as sent.
    stored = {tuple(r) for r in await db.fetch("SELECT project, model, id FROM trajectory_groups")}
    assert stored == good_keys
    assert await db.fetchval("SELECT count(*) FROM trajectories") == n_trajectories
    for *_, g in good[:20]:
        bodies = await db.fetch(
            "SELECT body::text FROM trajectories WHERE project = $1 AND model = $2 AND group_id = $3"
            " ORDER BY idx",
            g.project,
            g.model,
            g.id,
        )
        assert [msgspec.json.decode(b[0], type=Trajectory) for b in bodies] == g.trajectories
    ci = await js.consumer_info(subjects.TRAJECTORIES.name, subjects.COLLECTOR_CONSUMER)
    assert ci.num_redelivered == 0  # no batch failed because of a hostile neighbour

    # A different group under a stored group's key is a conflict: dead-lettered with both
    # hashes, never dropped in silence, and the stored one is left as it was.
    before = len(letters)
    changed = [msgspec.structs.replace(g, metadata={"changed": True}) for *_, g in good[:5]]
    for g in changed:
        await js.publish(
            subjects.trajectories(g.project, g.model),
            encode(g),
            headers=_headers(JSON, f"conflict.{bus.tenant_msg_id(g)}"),
        )

    async def conflicts_lettered():
        return len(await _letters(js, "collector")) >= before + len(changed)

    await wait_for(conflicts_lettered)
    conflicts = (await _letters(js, "collector"))[before:]
    assert sorted(letter.original_id for letter in conflicts) == sorted(g.id for g in changed)
    for letter in conflicts:
        assert letter.kind == "conflict", letter.reason
        assert re.search(r"stored body sha256 [0-9a-f]{64}, this one [0-9a-f]{64}", letter.reason)
    assert (
        await db.fetchval("SELECT count(*) FROM trajectory_groups WHERE metadata::text LIKE '%changed%'") == 0
    )

    # Still consuming.
    (collector,) = collectors
    assert collector.consumer.stats.dead_lettered and sum(collector.consumer.stats.dead_lettered.values()) > 0
    last = group(fz.PROJECT, fz.MODEL, size=2, seed=99)
    await js.publish(fz.TRAJ_SUBJECT, encode(last), headers=_headers(JSON, last.id))

    async def last_stored():
        return await db.fetchval("SELECT count(*) FROM trajectory_groups WHERE id = $1", last.id) == 1

    await wait_for(last_stored)
    print(
        "collector:",
        len(hostile),
        "hostile",
        dict(collections.Counter(h.label for h in hostile)),
        len(good_keys),
        "good",
    )


# --------------------------------------------------------------------------- the trainer


@pytest.mark.timeout(180 * fz.SCALE)
async def test_trainer_dead_letters_every_hostile_request_and_keeps_answering(nc, js, database_url, tmp_path):
    from artery.services.trainer.service import Trainer
    from artery.services.trainer.settings import TrainerSettings

    hostile: list[fz.Hostile] = fz.collect(fz.hostile_train_requests(), 250, at=20260102)
    # A registered, trainable model: well-formed requests for it are answered (train.failed, as
    # their groups never arrive), which is the good traffic here; no model is ever loaded.
    await register_trainable(js, fz.PROJECT, fz.MODEL, "none/none")
    trainer = Trainer(
        nc, database_url, TrainerSettings(checkpoint_dir=str(tmp_path / "ckpt"), group_wait_s=0.1)
    )
    await trainer.start()
    task = asyncio.create_task(trainer.run())
    try:
        outgoing = []
        good = []
        for i, h in enumerate(hostile):
            outgoing.append(
                (h.subject, h.payload, _headers(h.content_type, None if i % 7 == 0 else f"t-{i}"), h)
            )
            if i % 50 == 0:
                request = TrainRequested(
                    id=new_event_id(), project=fz.PROJECT, model=fz.MODEL, group_ids=[f"missing-{i}"]
                )
                good.append(request)
                outgoing.append((fz.TRAIN_SUBJECT, encode(request), _headers(JSON, request.id), None))
        futures = [await js.publish_async(s, p, headers=hd) for s, p, hd, _ in outgoing]
        acks = await asyncio.gather(*futures)
        by_seq = {ack.seq: h for ack, (*_, h) in zip(acks, outgoing, strict=True) if h is not None}
        assert len(by_seq) == len(hostile)
        failed_subject = subjects.train("failed", fz.PROJECT, fz.MODEL)

        async def settled():
            dead = (await js.stream_info(subjects.DLQ.name)).state.messages
            answered = await _on_subject(js, subjects.TRAINING.name, failed_subject)
            ci = await js.consumer_info(subjects.TRAINING.name, "trainer")
            return dead >= len(hostile) and answered >= len(good) and ci.num_pending + ci.num_ack_pending == 0

        await wait_for(settled, timeout=90 * fz.SCALE, interval=0.2)
        letters = await _letters(js, "trainer")
        assert len(letters) == len(hostile)
        assert {letter.stream_seq for letter in letters} == set(by_seq)
        problems: list[str] = []
        for letter in letters:
            _check_letter(letter, by_seq[letter.stream_seq], "trainer", problems)
        assert not problems, _summary(problems)
        assert await _on_subject(js, subjects.TRAINING.name, failed_subject) == len(good)
        ci = await js.consumer_info(subjects.TRAINING.name, "trainer")
        assert ci.num_redelivered == 0
        assert not task.done()
        print(
            "trainer:",
            len(hostile),
            "hostile",
            dict(collections.Counter(h.label for h in hostile)),
            len(good),
            "good",
        )
    finally:
        trainer.stop()
        await asyncio.wait_for(task, 10)
        await trainer.close()


# --------------------------------------------------------------------------- request/reply


@pytest.mark.timeout(120 * fz.SCALE)
async def test_control_subjects_answer_and_dead_letter_every_hostile_request(
    nc, js, database_url, common_settings
):
    gate = PauseGate(max_wait_s=5)
    control = ControlServer(nc, gate, replica_id="fuzz-replica", project=fz.PROJECT, model=fz.MODEL)
    publisher = Publisher(nc, database_url, PublisherSettings())
    retention = RetentionServer(nc, publisher)
    await control.start()
    await retention.start()
    client = await bus.connect(common_settings, name="fuzz-client")
    try:
        drawn: list[fz.Hostile] = fz.collect(fz.hostile_control_requests(), 400, at=20260103)
        # Replicas and the publisher name a dead letter after the bytes (N replicas: one letter),
        # so the same bytes twice are one letter: keep the first of each.
        unique = {(h.subject, h.payload): h for h in reversed(drawn)}
        hostile = list(reversed(unique.values()))
        problems: list[str] = []
        good = 0
        for i, h in enumerate(hostile):
            reply = await client.request(
                h.subject, h.payload, timeout=5, headers=_headers(h.content_type, f"c-{i}")
            )
            if h.label == "pause":
                ack = msgspec.json.decode(reply.data, type=PauseAck)
                if not ack.error or ack.paused:
                    problems.append(f"pause {h.payload[:80]!r}: acked {ack}")
            elif h.label == "resume":
                ack = msgspec.json.decode(reply.data, type=ResumeAck)
                if not ack.resumed or not ack.error:  # refused, and nothing was paused
                    problems.append(f"resume {h.payload[:80]!r}: {ack}")
            else:
                applied = msgspec.json.decode(reply.data, type=RetentionApplied)
                if not applied.error or not any(applied.error.startswith(k) for k in h.kinds):
                    problems.append(f"retain {h.payload[:80]!r}: {applied.error!r}, expected {set(h.kinds)}")
            if i % 25 == 0:  # good traffic between: a pause and its resume, a retention request
                good += 1
                lease = f"good-{i}"
                pause = fz.set_path(fz._PAUSE, ("lease_id",), lease) | {"id": new_event_id()}
                ack = msgspec.json.decode(
                    (await client.request(fz.PAUSE_SUBJECT, encode(pause), timeout=5)).data, type=PauseAck
                )
                assert ack.paused and ack.error is None and gate.paused
                resume = fz.set_path(fz._RESUME, ("lease_id",), lease) | {"id": new_event_id()}
                reply = await client.request(fz.RESUME_SUBJECT, encode(resume), timeout=5)
                assert msgspec.json.decode(reply.data, type=ResumeAck).resumed and not gate.paused
                retain = fz._RETAIN | {"id": new_event_id(), "keep_latest": 2}
                reply = await client.request(fz.RETAIN_SUBJECT, encode(retain), timeout=5)
                assert msgspec.json.decode(reply.data, type=RetentionApplied).error is None
        assert not problems, _summary(problems)
        assert not gate.paused

        # Subjects nobody serves (another model, an extra token): the requester hears so at once.
        for subject in (
            "artery.control.inference.fz.other.pause",
            "artery.control.inference.fz.agent.x.resume",
            "artery.control.publisher.fz.agent.x.retain",
        ):
            with pytest.raises(NoRespondersError):
                await client.request(subject, encode(fz._PAUSE), timeout=2)

        for service, labels in (("inference", {"pause", "resume"}), ("publisher", {"retain"})):
            # Matched by subject and payload (cut to the 16 KiB a control dead letter keeps).
            expected: dict[tuple, list[fz.Hostile]] = collections.defaultdict(list)
            for h in hostile:
                if h.label in labels:
                    expected[(h.subject, h.payload[:CONTROL_DLQ_PAYLOAD])].append(h)
            n_expected = sum(map(len, expected.values()))

            async def all_dead_lettered(service=service, n_expected=n_expected):
                return len(await _letters(js, service)) >= n_expected

            await wait_for(all_dead_lettered, timeout=30, interval=0.2)
            letters = await _letters(js, service)
            assert len(letters) == n_expected, service
            for letter in letters:
                same = expected[(letter.subject, letter.payload)]
                _check_letter(letter, same.pop(), service, problems)
        assert not problems, _summary(problems)
        print(
            "control:",
            len(hostile),
            "hostile",
            dict(collections.Counter(h.label for h in hostile)),
            good,
            "good",
        )
    finally:
        await client.close()
        await control.stop()
        await retention.stop()
        await publisher.close()


# --------------------------------------------------------------------------- HTTP


def _api(max_context: int = 400) -> tuple[httpx.AsyncClient, FakeEngine]:
    engine = FakeEngine(max_context=max_context)
    app = create_app(ServingState(engine, "fake"), max_body_bytes=fz.HTTP_MAX_BODY)
    # raise_app_exceptions=False: a 500 must be seen as a response, as a client would see it.
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://fuzz"), engine


async def _chunks(body: bytes):
    yield body


def _openai_error(response: httpx.Response) -> str | None:
    """What is wrong with an error response's shape, or None."""
    try:
        body = response.json()
    except ValueError:
        return f"not JSON: {response.text[:200]!r}"
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict) or set(error) != {"message", "type", "param", "code"}:
        return f"not OpenAI's shape: {body!r:.200}"
    if not isinstance(error["message"], str) or not error["message"] or not isinstance(error["type"], str):
        return f"empty message or type: {error!r:.200}"
    return None


@pytest.mark.timeout(120 * fz.SCALE)
async def test_inference_api_answers_every_hostile_request_with_an_openai_error():
    hostile: list[fz.HostileHttp] = fz.collect(fz.hostile_http_requests(400), 450, at=20260104)
    client, _ = _api()
    problems: list[str] = []
    good = 0
    async with client:
        for i, h in enumerate(hostile):
            # An iterator has no length: httpx sends it chunked, without Content-Length.
            body = _chunks(h.body) if h.chunked else h.body
            response = await client.request(
                h.method, h.path, content=body, headers={"content-type": h.content_type}
            )
            where = f"{h.label} {h.method} {h.path} {h.body[:100]!r}"
            if response.status_code not in h.statuses:
                problems.append(f"{where}: {response.status_code} {response.text[:200]}")
            elif response.status_code == 200:
                pass  # (any_json: that value happened to be valid)
            elif shape := _openai_error(response):
                problems.append(f"{where}: {shape}")
            elif h.code and response.json()["error"]["code"] != h.code:
                problems.append(f"{where}: code {response.json()['error']['code']!r}, expected {h.code!r}")
            if i % 10 == 0:  # good traffic between
                good += 1
                document = fz.GOOD_CHAT | {"n": 1 + i % 3, "stream": i % 20 == 0}
                response = await client.post("/v1/chat/completions", json=document)
                assert response.status_code == 200, response.text
                if not document["stream"]:
                    assert len(response.json()["choices"]) == document["n"]
                else:
                    assert response.text.rstrip().endswith("data: [DONE]")
        assert (await client.get("/health")).status_code == 200
    assert not problems, _summary(problems)
    print("http:", len(hostile), "hostile", dict(collections.Counter(h.label for h in hostile)), good, "good")


# --------------------------------------------------------------------------- known gaps

_GAP_PAYLOADS = {
    "invalid_utf8_json": (fz.with_bad_utf8(fz._train_doc(), ("group_ids", 0), b"\xff", JSON), JSON),
    "invalid_utf8_msgpack": (
        fz.with_bad_utf8(fz._train_doc(), ("group_ids", 0), b"\xed\xa0\x80", MSGPACK),
        MSGPACK,
    ),
    "deep_json": (fz.with_raw(fz._train_doc(), ("x",), fz.deep_bytes(JSON, 10_000, "list"), JSON), JSON),
    "deep_msgpack": (
        fz.with_raw(fz._train_doc(), ("x",), fz.deep_bytes(MSGPACK, 10_000, "list"), MSGPACK),
        MSGPACK,
    ),
}


@pytest.mark.parametrize("case", sorted(_GAP_PAYLOADS))
def test_shared_decoder_rejects_invalid_utf8_and_deep_nesting(case):
    payload, content_type = _GAP_PAYLOADS[case]
    with pytest.raises(InvalidMessage) as caught:
        EventDecoder(TrainRequested).decode(payload, content_type)
    assert caught.value.kind == "decode"


@pytest.mark.parametrize("case", ["invalid_utf8", "surrogate", "deep_list", "deep_tool_parameters"])
async def test_inference_api_rejects_invalid_utf8_and_deep_nesting_with_400(case):
    body = {
        "invalid_utf8": fz.with_bad_utf8(fz.GOOD_CHAT, ("messages", 0, "content"), b"\xff", JSON),
        "surrogate": fz.with_bad_utf8(fz.GOOD_CHAT, ("model",), b"\xed\xa0\x80", JSON),
        "deep_list": fz.with_raw(fz.GOOD_CHAT, ("x",), fz.deep_bytes(JSON, 10_000, "list"), JSON),
        "deep_tool_parameters": fz.with_raw(
            fz.GOOD_CHAT | {"tools": [{"function": {"name": "f", "parameters": {}}}]},
            ("tools", 0, "function", "parameters", "p"),
            fz.deep_bytes(JSON, 10_000, "object"),
            JSON,
        ),
    }[case]
    client, _ = _api()
    async with client:
        response = await client.post("/v1/chat/completions", content=body)
    assert response.status_code == 400, response.text[:300]
    assert _openai_error(response) is None


@pytest.mark.timeout(60)
async def test_trainer_rejects_a_request_for_another_model_than_its_subject(nc, js, database_url, tmp_path):
    from artery.services.trainer.service import Trainer
    from artery.services.trainer.settings import TrainerSettings

    await register_trainable(js, fz.PROJECT, fz.MODEL, "none/none")
    trainer = Trainer(
        nc, database_url, TrainerSettings(checkpoint_dir=str(tmp_path / "ckpt"), group_wait_s=0.1)
    )
    await trainer.start()
    task = asyncio.create_task(trainer.run())
    try:
        request = TrainRequested(id=new_event_id(), project=fz.PROJECT, model=fz.MODEL, group_ids=["g"])
        await js.publish(
            subjects.train("requested", "other", fz.MODEL),
            encode(request),
            headers=_headers(JSON, request.id),
        )

        async def dead_lettered():
            return len(await _letters(js, "trainer")) == 1

        await wait_for(dead_lettered, timeout=5)
        (letter,) = await _letters(js, "trainer")
        assert letter.kind == "subject_mismatch" and "requested on" in letter.reason
        assert letter.original_id == request.id
    finally:
        trainer.stop()
        await asyncio.wait_for(task, 10)
        await trainer.close()


async def test_a_rejected_pause_is_answered_with_a_valid_ack(nc):
    control = ControlServer(nc, PauseGate(max_wait_s=5), replica_id="r", project=fz.PROJECT, model=fz.MODEL)
    await control.start()
    try:
        request = fz.set_path(fz._PAUSE, ("lease_id",), "a\x00b")
        reply = await nc.request(fz.PAUSE_SUBJECT, encode(request), timeout=5)
        ack = msgspec.json.decode(reply.data, type=PauseAck)
        assert ack.error and not ack.paused
    finally:
        await control.stop()


@pytest.mark.timeout(60)
async def test_trainer_rejects_a_non_finite_config_sent_as_msgpack(nc, js, database_url, tmp_path):
    from artery.schemas import TrainConfig
    from artery.services.trainer.service import Trainer
    from artery.services.trainer.settings import TrainerSettings

    trainer = Trainer(nc, database_url, TrainerSettings(checkpoint_dir=str(tmp_path / "ckpt")))
    await trainer.start()
    task = asyncio.create_task(trainer.run())
    try:
        config = TrainConfig(learning_rate=float("inf"), max_grad_norm=float("nan"))
        request = TrainRequested(
            id=new_event_id(), project=fz.PROJECT, model=fz.MODEL, group_ids=["g"], config=config
        )
        await js.publish(
            subjects.train("requested", fz.PROJECT, fz.MODEL),
            encode(request, MSGPACK),
            headers=_headers(MSGPACK, request.id),
        )

        async def dead_lettered():
            return len(await _letters(js, "trainer")) == 1

        await wait_for(dead_lettered, timeout=10)
        (letter,) = await _letters(js, "trainer")
        assert letter.kind == "non_finite"
        assert "learning_rate" in letter.reason and "max_grad_norm" in letter.reason
    finally:
        trainer.stop()
        await asyncio.wait_for(task, 10)
        await trainer.close()
