"""An agent chooses its group's judge model; the reward service calls it with the operator's
endpoint and key. These tests hold the service to: only judges on the operator's allow-list are
ever called, nothing else in a group's spec reaches litellm, a judge that cannot be called as
configured is a verdict at once (not an outage retried for ever), and a judge that stays down is
given up after a bounded number of deliveries. Every group given up on still gets its
``group_rewards`` row, so the trainer leaves it out instead of waiting for it.

Real nats-server, PostgreSQL, collector and reward service (in process); the judges are real
HTTP servers on loopback: the scripted one, and here one that answers chosen statuses.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import msgspec
import pytest

from artery.schemas import GroupReady, RulerSpec
from artery.services.collector.store import StoredGroup, write_groups
from artery.services.reward.judges import FORBIDDEN_JUDGE, JUDGE_CONFIG, RULER, JudgeRefused, chosen_judge
from artery.services.reward.judges import error_kind as stored_kind
from artery.services.reward.service import RewardService
from artery.services.reward.settings import RewardSettings
from artery.services.reward.store import Verdict, record_verdict, stored_verdict
from artery.services.trainer.store import load_groups, stored_group_ids
from artery.shared import subjects
from artery.shared.bus import event_headers
from artery.shared.embedded import free_port
from artery.shared.errors import InvalidMessage
from artery.testing.judge import scores_json, serve_scripted_judge
from tests.helpers import wait_for
from tests.test_reward_service import (
    MODEL,
    PROJECT,
    dead_letters,
    reward_services,
    ruler_group,
    scored_events,
    submit,
)

EVIL_DEFAULT = "openai/gpt-4o@http://127.0.0.1:1/evil"  # the string found in the wild


class StatusJudge:
    """An OpenAI-compatible judge answering each request with the next scripted status (the last
    repeating); a 200 carries ``content``. Records every request body."""

    def __init__(self, statuses: tuple[int, ...], content: str):
        self.statuses = list(statuses)
        self.content = content
        self.requests: list[dict] = []
        self.url = ""

    def answer(self, body: dict) -> tuple[int, dict]:
        self.requests.append(body)
        status = self.statuses.pop(0) if len(self.statuses) > 1 else self.statuses[0]
        if status != 200:
            return status, {"error": {"message": f"scripted status {status}", "type": "test"}}
        return 200, {
            "id": f"chatcmpl-{len(self.requests)}",
            "object": "chat.completion",
            "created": 0,
            "model": body.get("model", "judge"),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": self.content},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 10, "completion_tokens": 10, "total_tokens": 20},
        }

    @property
    def api_base(self) -> str:
        return self.url + "/v1"


@contextmanager
def serve_status_judge(*statuses: int, content: str = "") -> Iterator[StatusJudge]:
    judge = StatusJudge(statuses or (200,), content)

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{}")
            status, answer = judge.answer(body)
            data = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):  # the test's output is the assertions'
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    judge.url = f"http://127.0.0.1:{server.server_port}"
    try:
        yield judge
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.fixture
def judge():
    with serve_scripted_judge() as j:
        j.answers = [scores_json(("1", 0.25), ("2", 0.75))]
        yield j


@pytest.fixture
def evil():
    """Where a hostile spec would like the operator's key to go: it must never hear from us."""
    with serve_status_judge(200, content=scores_json(("1", 1.0), ("2", 1.0))) as e:
        yield e


@pytest.fixture
async def start_reward(nc, database_url):
    """An in-process reward service calling the judge at ``api_base`` with the key ``x``."""
    async with reward_services(nc, database_url) as start:
        yield start


async def verdict_row(db, group_id: str):
    return await db.fetchrow(
        "SELECT judge_model, error, attempts FROM group_rewards WHERE group_id = $1", group_id
    )


async def assert_left_out_by_the_trainer(db, group_id: str) -> None:
    """The contract with the trainer: ready (it does not wait), and not trained on."""
    assert await stored_group_ids(db, PROJECT, MODEL, [group_id]) == {group_id}
    assert await load_groups(db, PROJECT, MODEL, [group_id]) == []


async def settled(service: RewardService, kind: str) -> dict[str, int]:
    """The consumer's count of dead letters, once it has terminated the one of ``kind``."""

    async def counted():
        return service.consumer.stats.dead_lettered.get(kind, 0) >= 1

    await wait_for(counted)
    return service.consumer.stats.dead_lettered


# ---------------------------------------------------------------- pure parts


def test_only_exact_names_on_the_allow_list_are_chosen():
    allowed = frozenset({"openai/judge", "openai/strict-judge"})
    assert chosen_judge(None, "openai/judge", allowed) == "openai/judge"
    assert chosen_judge(RulerSpec(), "openai/judge", allowed) == "openai/judge"
    assert chosen_judge(RulerSpec(judge_model="openai/strict-judge"), "openai/judge", allowed) == (
        "openai/strict-judge"
    )
    for hostile in (
        EVIL_DEFAULT,
        "openai/judge ",
        "OPENAI/judge",
        "openai/strict-judge@http://x",
        "azure/judge",
    ):
        with pytest.raises(JudgeRefused) as refused:
            chosen_judge(RulerSpec(judge_model=hostile), "openai/judge", allowed)
        assert refused.value.kind == FORBIDDEN_JUDGE
    with pytest.raises(JudgeRefused) as refused:
        chosen_judge(RulerSpec(judge_model="  "), "openai/judge", allowed)
    assert refused.value.kind == JUDGE_CONFIG


def test_the_allow_list_setting_always_holds_the_configured_judge():
    settings = RewardSettings(judge_model="openai/judge", allowed_judges=" openai/a,openai/b ,,")
    assert settings.allowed_judge_models() == {"openai/judge", "openai/a", "openai/b"}
    assert RewardSettings(judge_model="openai/judge").allowed_judge_models() == {"openai/judge"}


def test_stored_errors_keep_their_kind():
    assert stored_kind("forbidden_judge: judge model 'x' is not allowed") == (
        FORBIDDEN_JUDGE,
        "judge model 'x' is not allowed",
    )
    # Errors stored before kinds were (and any text that merely looks like one) are RULER's.
    assert stored_kind("RULER judge j failed after 2 attempts: x") == (
        RULER,
        "RULER judge j failed after 2 attempts: x",
    )
    assert stored_kind("poison: x") == (RULER, "poison: x")


# ---------------------------------------------------------------- through the service


@pytest.mark.parametrize(
    "judge_model",
    [EVIL_DEFAULT, "{evil}", "anthropic/claude-3-5-sonnet-20241022", "openai/judge ", "openai/strict-judge2"],
    ids=["found-in-the-wild", "evil-listening", "other-provider", "trailing-space", "not-listed"],
)
async def test_a_judge_off_the_allow_list_is_never_called(
    js, db, run_collector, start_reward, judge, evil, judge_model
):
    judge_model = judge_model.replace("{evil}", f"openai/gpt-4o@{evil.url}/evil")
    await run_collector()
    service = await start_reward(judge.api_base, allowed_judges="openai/strict-judge")
    g = ruler_group(size=2, spec=RulerSpec(judge_model=judge_model))
    await submit(js, run_collector, g)

    [letter] = await dead_letters(js)
    assert letter.kind == FORBIDDEN_JUDGE and "allow-list" in letter.reason
    assert judge.requests == [] and evil.requests == []  # nobody was sent the key, nor asked
    assert await settled(service, FORBIDDEN_JUDGE) == {FORBIDDEN_JUDGE: 1}
    assert service.consumer.stats.retried == 0
    row = await verdict_row(db, g.id)
    assert row["error"].startswith("forbidden_judge: ") and row["attempts"] == 0
    assert row["judge_model"] == judge_model  # what was asked for, for the operator to see
    await assert_left_out_by_the_trainer(db, g.id)


async def test_a_spec_cannot_smuggle_an_address_or_litellm_arguments(
    js, db, run_collector, start_reward, judge, evil
):
    """The wire spec has the judge model, the rubric and combine_with_reward; anything else an
    agent adds is dropped at decoding and never reaches the judge call."""
    await run_collector()
    await start_reward(judge.api_base)
    g = ruler_group(size=2, spec=RulerSpec(judge_model="openai/judge"))
    body = msgspec.json.decode(msgspec.json.encode(g))
    smuggled = {
        "api_base": evil.api_base,
        "base_url": evil.api_base,
        "api_key": "the-agent's",
        "extra_headers": {"x-forward-to": evil.url},
        "litellm_params": {"api_base": evil.api_base},
        "extra_body": {"api_base": evil.api_base},
    }
    body["reward"]["ruler"].update(smuggled)
    body["reward"].update(smuggled)
    await js.publish(
        subjects.trajectories(PROJECT, MODEL), json.dumps(body).encode(), headers=event_headers(g)
    )

    [scored] = await scored_events(js)
    assert [s.score for s in scored.scores] == [0.25, 0.75]
    assert evil.requests == []
    [request] = judge.requests  # the operator's judge, called the usual way
    assert not set(smuggled) & set(request), sorted(request)
    assert request["model"] == "judge"
    stored = json.loads(
        await db.fetchval("SELECT reward_spec::text FROM trajectory_groups WHERE id = $1", g.id)
    )
    assert stored == {"ruler": {"judge_model": "openai/judge"}}


async def test_an_allowed_judge_is_called(js, db, run_collector, start_reward, judge):
    await run_collector()
    await start_reward(judge.api_base, allowed_judges="openai/strict-judge, openai/other-judge")
    g = ruler_group(size=2, spec=RulerSpec(judge_model="openai/other-judge"))
    await submit(js, run_collector, g)
    [scored] = await scored_events(js)
    assert scored.judge_model == "openai/other-judge" and [s.score for s in scored.scores] == [0.25, 0.75]
    [request] = judge.requests
    assert request["model"] == "other-judge"


async def test_an_empty_ruler_spec_without_credentials_is_a_config_error_at_once(
    js, db, run_collector, start_reward, judge, monkeypatch
):
    """``ruler: {}`` asks for the configured judge; the deployment gave it no key. litellm reports
    that as a 500 of its own making: it must not be taken for an outage and retried."""
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    await run_collector()
    service = await start_reward(judge.api_base, judge_api_key=None)
    g = ruler_group(size=2, spec=RulerSpec())
    assert msgspec.json.encode(g.reward) == b'{"ruler":{}}'
    await submit(js, run_collector, g)

    [letter] = await dead_letters(js)
    assert letter.kind == JUDGE_CONFIG and "Missing credentials" in letter.reason
    assert judge.requests == []
    assert await settled(service, JUDGE_CONFIG) == {JUDGE_CONFIG: 1}
    assert service.consumer.stats.retried == 0  # one delivery, not dozens
    row = await verdict_row(db, g.id)
    assert row["error"].startswith("judge_config: ") and row["attempts"] == 1
    await assert_left_out_by_the_trainer(db, g.id)


@pytest.mark.parametrize("status", [400, 401, 403, 404])
async def test_a_judge_that_refuses_the_deployment_is_a_config_error_at_once(
    js, db, run_collector, start_reward, status
):
    with serve_status_judge(status) as refusing:
        await run_collector()
        service = await start_reward(refusing.api_base)
        g = ruler_group(size=2)
        await submit(js, run_collector, g)
        [letter] = await dead_letters(js)
        assert letter.kind == JUDGE_CONFIG and f"scripted status {status}" in letter.reason
        assert len(refusing.requests) == 1  # asked once: no retry of any kind
        assert await settled(service, JUDGE_CONFIG) == {JUDGE_CONFIG: 1}
        assert service.consumer.stats.retried == 0
        assert (await verdict_row(db, g.id))["attempts"] == 1
        await assert_left_out_by_the_trainer(db, g.id)


@pytest.mark.parametrize(
    "judge_model, allowed, said",
    [
        ("nonsense", "nonsense", "LLM Provider NOT provided"),  # allowed, but not a litellm model
        ("bogus-provider/judge", "bogus-provider/judge", "LLM Provider NOT provided"),
        ("", "", "empty judge_model"),  # named, but blank
    ],
    ids=["no-provider", "unknown-provider", "blank"],
)
async def test_a_judge_litellm_cannot_call_is_a_config_error_at_once(
    js, db, run_collector, start_reward, judge, judge_model, allowed, said
):
    await run_collector()
    service = await start_reward(judge.api_base, allowed_judges=allowed)
    g = ruler_group(size=2, spec=RulerSpec(judge_model=judge_model))
    await submit(js, run_collector, g)
    [letter] = await dead_letters(js)
    assert letter.kind == JUDGE_CONFIG and said in letter.reason
    assert judge.requests == []
    assert await settled(service, JUDGE_CONFIG) == {JUDGE_CONFIG: 1}
    assert service.consumer.stats.retried == 0
    await assert_left_out_by_the_trainer(db, g.id)


@pytest.mark.parametrize("down", ["refused", 503, 429])
async def test_a_judge_that_stays_down_is_given_up_after_the_bound(js, db, run_collector, start_reward, down):
    with serve_status_judge(503 if down == "refused" else down) as failing:
        api_base = f"http://127.0.0.1:{free_port()}/v1" if down == "refused" else failing.api_base
        await run_collector()
        service = await start_reward(api_base, judge_outage_max_deliveries=3)
        g = ruler_group(size=2)
        await submit(js, run_collector, g)

        [letter] = await dead_letters(js, timeout=60)
        assert letter.kind == "judge_unavailable" and "at delivery 3" in letter.reason
        assert service.consumer.stats.retried == 2  # deliveries 1 and 2 waited for the judge
        row = await verdict_row(db, g.id)
        assert row["error"].startswith("judge_unavailable: ") and row["attempts"] == 3
        await assert_left_out_by_the_trainer(db, g.id)
        if down != "refused":
            assert len(failing.requests) >= 3  # every delivery tried the judge


async def test_a_judge_back_within_the_bound_scores_the_group(js, db, run_collector, start_reward):
    """The bound gives up on a dead judge; it does not shorten an outage the judge recovers from.
    The first delivery meets only 503s (the client's own retries included), the next a judge."""
    with serve_status_judge(503, 503, 503, 200, content=scores_json(("1", 0.4), ("2", 0.6))) as flaky:
        await run_collector()
        service = await start_reward(flaky.api_base, judge_outage_max_deliveries=5)
        g = ruler_group(size=2)
        await submit(js, run_collector, g)
        [scored] = await scored_events(js)
        assert [s.score for s in scored.scores] == [0.4, 0.6]
        assert service.consumer.stats.retried >= 1 and service.consumer.stats.dead_lettered == {}
        assert (await verdict_row(db, g.id))["error"] is None


async def test_a_redelivery_dead_letters_a_stored_refusal_with_its_kind(
    js, db, run_collector, nc, database_url, judge
):
    """The kind is kept with the stored error: a redelivery (or another replica) that finds the
    verdict in PostgreSQL rejects the group the same way, and still calls nobody."""
    await run_collector()
    g = ruler_group(size=2, spec=RulerSpec(judge_model=EVIL_DEFAULT))
    await submit(js, run_collector, g)
    await wait_for(lambda: db.fetchval("SELECT count(*) FROM trajectory_groups"))
    ready = GroupReady(
        id=f"ready-{g.id}", project=PROJECT, model=MODEL, group_id=g.id, num_trajectories=2,
        rewards=[t.reward for t in g.trajectories], needs_reward=True,
    )  # fmt: skip
    settings = RewardSettings(judge_model="openai/judge", judge_api_base=judge.api_base, judge_api_key="x")
    first, second = RewardService(nc, database_url, settings), RewardService(nc, database_url, settings)
    try:
        for service in (first, second):
            with pytest.raises(InvalidMessage) as rejected:
                await service.score(ready)
            assert rejected.value.kind == FORBIDDEN_JUDGE
    finally:
        await first.close()
        await second.close()
    assert judge.requests == []
    assert await db.fetchval("SELECT count(*) FROM group_rewards") == 1


async def test_a_judge_answer_or_rubric_holding_a_nul_is_recorded_not_retried_into_poison(db):
    """PostgreSQL's text cannot hold U+0000: a random judge (the tiny model as a judge) can answer
    one, which the error quotes. The verdict is recorded with U+FFFD in its place; failing on it
    failed every redelivery until the group was dead-lettered as poison (seen in CI)."""
    g = ruler_group(size=2)
    await write_groups(db, [StoredGroup.of(g, None)])
    verdict = Verdict(
        judge_model="openai/judge",
        error="ruler: not valid JSON: a\x00b",
        attempts=2,
        prompt_tokens=0,
        completion_tokens=0,
        cost_usd=None,
        rows=[(0, 0.5, 0.5, 0.0, "why\x00not")],
    )
    await record_verdict(db, (PROJECT, MODEL, g.id), verdict, "rubric\x00")
    stored = await stored_verdict(db, (PROJECT, MODEL, g.id))
    assert stored.error == "ruler: not valid JSON: a\ufffdb"
    assert stored.rows == [(0, 0.5, 0.5, 0.0, "why\ufffdnot")]
