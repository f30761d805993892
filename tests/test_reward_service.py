"""The reward service against a real nats-server, PostgreSQL and an HTTP judge (scripted, or
Artery's own inference replica)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import re

import msgspec
import pytest

from artery.rewards.ruler import SYSTEM_PROMPT
from artery.schemas import (
    DeadLetter,
    FunctionDefinition,
    GroupReady,
    GroupScored,
    RewardSpec,
    RulerSpec,
    Tool,
)
from artery.services.collector.service import ready_event_id
from artery.services.reward.service import RewardService, scored_event_id
from artery.services.reward.settings import RewardSettings
from artery.services.trainer.store import load_groups, stored_group_ids
from artery.shared import subjects
from artery.shared.bus import publish_event
from artery.shared.embedded import free_port
from artery.shared.errors import DependencyUnavailable, InvalidMessage
from artery.testing.judge import scores_json, serve_scripted_judge
from tests.factories import group
from tests.helpers import wait_for

PROJECT, MODEL = "demo", "agent"
CALCULATOR = Tool(function=FunctionDefinition(name="add", description="add two numbers", parameters={}))


@pytest.fixture
def judge():
    with serve_scripted_judge() as j:
        yield j


@contextlib.asynccontextmanager
async def reward_services(nc, database_url):
    """Starts in-process reward services (the service's own code) calling the judge at an
    ``api_base`` with the key ``x``; all stopped when the block ends."""
    started: list[tuple[RewardService, asyncio.Task]] = []

    async def start(api_base: str, **overrides) -> RewardService:
        settings = RewardSettings(
            **{
                "judge_model": "openai/judge",
                "judge_api_base": api_base,
                "judge_api_key": "x",
                "fetch_timeout_s": 0.05,
                "backoff_max_s": 0.5,
                **overrides,
            }
        )
        service = RewardService(nc, database_url, settings)
        await service.start()
        started.append((service, asyncio.create_task(service.run())))
        return service

    try:
        yield start
    finally:
        for service, task in started:
            service.stop()
            await asyncio.wait_for(task, 10)
            await service.close()


@pytest.fixture
async def run_reward(nc, database_url, judge):
    """An in-process reward service pointed at the scripted judge."""
    async with reward_services(nc, database_url) as start:
        yield functools.partial(start, judge.api_base)


def ruler_group(size: int = 3, spec: RulerSpec | None = None, **kw):
    g = group(PROJECT, MODEL, size=size, reward=RewardSpec(ruler=spec or RulerSpec()), **kw)
    for t in g.trajectories:
        t.tools = [CALCULATOR]
    return g


async def submit(js, run_collector, g) -> None:
    await publish_event(js, subjects.trajectories(PROJECT, MODEL), g)


async def read_stream(js, subject: str, type_, timeout: float, count: int) -> list:
    """Up to ``count`` events stored under ``subject``, waiting at most ``timeout`` seconds."""
    sub = await js.subscribe(subject, ordered_consumer=True)
    found = []
    deadline = asyncio.get_running_loop().time() + timeout
    try:
        while len(found) < count:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                break
            try:
                msg = await sub.next_msg(timeout=left)
            except TimeoutError:
                break
            found.append(msgspec.json.decode(msg.data, type=type_))
    finally:
        await sub.unsubscribe()
    return found


async def scored_events(js, timeout: float = 30.0, count: int = 1) -> list[GroupScored]:
    return await read_stream(js, subjects.group_scored(PROJECT, MODEL), GroupScored, timeout, count)


async def dead_letters(js, timeout: float = 30.0) -> list[DeadLetter]:
    return await read_stream(js, subjects.dead_letter("reward"), DeadLetter, timeout, 1)


async def stored_ruler_group(js, db, run_collector) -> GroupReady:
    """A two-trajectory group asking for RULER, stored by a real collector; returned as the
    ``group.ready`` the collector announces, for tests that hand it to the service themselves."""
    await run_collector()
    g = ruler_group(size=2)
    await submit(js, run_collector, g)
    await wait_for(lambda: db.fetchval("SELECT count(*) FROM trajectory_groups"))
    return GroupReady(
        id=ready_event_id(PROJECT, MODEL, g.id), project=PROJECT, model=MODEL, group_id=g.id,
        num_trajectories=2, rewards=[t.reward for t in g.trajectories], needs_reward=True,
    )  # fmt: skip


def by_content(*scores: float):
    """A judge that scores trajectory ids in the order the request lists them (ids as sent)."""

    def answer(body: dict) -> str:
        ids = re.findall(r'<trajectory id="(\d+)">', body["messages"][1]["content"])
        return scores_json(*zip(ids, scores, strict=True))

    return answer


async def test_group_without_ruler_is_left_alone(js, db, run_collector, run_reward, judge):
    judge.answers = [scores_json(("1", 1.0))]
    await run_collector()
    service = await run_reward()
    g = group(PROJECT, MODEL, size=2)
    await submit(js, run_collector, g)
    await wait_for(lambda: _processed(service, 1))
    assert judge.requests == []
    assert await db.fetchval("SELECT count(*) FROM group_rewards") == 0
    async with db.transaction():
        assert await stored_group_ids(db, PROJECT, MODEL, [g.id]) == {g.id}  # ready to train as submitted


async def _processed(service: RewardService, n: int) -> bool:
    return service.consumer.stats.processed >= n


async def test_scores_are_stored_announced_and_used_by_the_trainer(js, db, run_collector, run_reward, judge):
    judge.answers = [scores_json(("2", 0.1), ("1", 0.9), ("3", 0.6))]  # shuffled: matched by id
    await run_collector()
    await run_reward()
    g = ruler_group(size=3)
    await submit(js, run_collector, g)
    [scored] = await scored_events(js)

    assert scored.id == scored_event_id(PROJECT, MODEL, g.id) and scored.group_id == g.id
    assert [(s.index, s.score, s.judge_score) for s in scored.scores] == [
        (0, 0.9, 0.9),
        (1, 0.1, 0.1),
        (2, 0.6, 0.6),
    ]
    assert [s.independent_reward for s in scored.scores] == [t.reward for t in g.trajectories]
    assert scored.judge_model == "openai/judge"
    assert (scored.usage.attempts, scored.usage.prompt_tokens, scored.usage.completion_tokens) == (1, 10, 10)

    # The judge saw the tools and the conversations, but none of the sampled tokens.
    [request] = judge.requests
    assert request["model"] == "judge" and request["response_format"]["type"] == "json_schema"
    prompt = request["messages"][1]["content"]
    assert "<available_tools>" in prompt and '"add"' in prompt
    assert "token_ids" not in prompt and "logprobs" not in prompt

    rows = await db.fetch("SELECT idx, reward, independent_reward FROM trajectory_rewards ORDER BY idx")
    assert [(r["idx"], r["reward"]) for r in rows] == [(0, 0.9), (1, 0.1), (2, 0.6)]
    assert await stored_group_ids(db, PROJECT, MODEL, [g.id]) == {g.id}
    [trajectories] = await load_groups(db, PROJECT, MODEL, [g.id])
    assert [t.reward for t in trajectories] == [0.9, 0.1, 0.6]
    assert [t.metrics["independent_reward"] for t in trajectories] == [t.reward for t in g.trajectories]


async def test_trainer_waits_for_the_judge(js, db, run_collector):
    """A stored group that asked for RULER is not ready to train until it has a verdict."""
    await run_collector()
    g = ruler_group(size=2)
    await submit(js, run_collector, g)
    await wait_for(lambda: db.fetchval("SELECT count(*) FROM trajectory_groups"))
    assert await stored_group_ids(db, PROJECT, MODEL, [g.id]) == set()


async def test_missing_id_is_asked_again_and_out_of_range_clamped(js, db, run_collector, run_reward, judge):
    judge.answers = [scores_json(("1", 0.5)), scores_json(("1", 1.7), ("2", -3.0))]
    await run_collector()
    await run_reward()
    g = ruler_group(size=2)
    await submit(js, run_collector, g)
    [scored] = await scored_events(js)
    assert [s.score for s in scored.scores] == [1.0, 0.0]
    assert scored.usage.attempts == 2 and scored.usage.prompt_tokens == 20
    assert len(judge.requests) == 2


@pytest.mark.parametrize(
    "answer, reason",
    [
        ("this is not json {", "not valid JSON"),
        (scores_json(("1", 0.5)), "missing ids"),
        (scores_json(("1", 0.5), ("2", 0.5), ("7", 0.5)), "unknown trajectory id"),
        (json.dumps({"grades": []}), 'no "scores" list'),
    ],
)
async def test_an_answer_that_stays_wrong_dead_letters_the_group(
    js, db, run_collector, run_reward, judge, answer, reason
):
    judge.answers = [answer]
    await run_collector()
    await run_reward(max_attempts=2)
    g = ruler_group(size=2)
    await submit(js, run_collector, g)
    [letter] = await dead_letters(js)
    assert letter.kind == "ruler" and reason in letter.reason and "after 2 attempts" in letter.reason
    assert letter.original_id == ready_event_id(PROJECT, MODEL, g.id)
    assert len(judge.requests) == 2
    # The trainer does not wait for it, and leaves it out.
    assert await stored_group_ids(db, PROJECT, MODEL, [g.id]) == {g.id}
    assert await load_groups(db, PROJECT, MODEL, [g.id]) == []
    assert await scored_events(js, timeout=0.5) == []


async def test_redelivery_never_calls_the_judge_twice(js, db, run_collector, nc, database_url, judge):
    judge.answers = [by_content(0.2, 0.8)]
    ready = await stored_ruler_group(js, db, run_collector)
    settings = RewardSettings(judge_model="openai/judge", judge_api_base=judge.api_base, judge_api_key="x")
    first, second = RewardService(nc, database_url, settings), RewardService(nc, database_url, settings)
    try:
        a = await first.score(ready)
        b = await second.score(ready)  # another replica, or a redelivery after a crash
    finally:
        await first.close()
        await second.close()
    assert len(judge.requests) == 1
    assert (a.id, a.scores, a.usage) == (b.id, b.scores, b.usage)  # same rewards, same event id
    assert await db.fetchval("SELECT count(*) FROM trajectory_rewards") == 2
    info = await js.stream_info(subjects.GROUPS.name)
    scored = await scored_events(js, timeout=1, count=2)
    assert len(scored) == 1 and info.state.messages >= 2  # group.ready and one group.scored


async def test_per_group_judge_rubric_and_combined_reward(js, db, run_collector, run_reward, judge):
    judge.answers = [by_content(0.25, 0.75)]
    await run_collector()
    await run_reward(allowed_judges="openai/strict-judge")  # a group names only allowed judges
    spec = RulerSpec(
        judge_model="openai/strict-judge", rubric="Prefer short answers.", combine_with_reward=True
    )
    g = ruler_group(size=2, spec=spec)
    await submit(js, run_collector, g)
    [scored] = await scored_events(js)
    [request] = judge.requests
    assert request["model"] == "strict-judge"
    assert request["messages"][0]["content"] == SYSTEM_PROMPT.format(rubric="Prefer short answers.")
    independent = [t.reward for t in g.trajectories]
    assert [s.score for s in scored.scores] == [0.25 + independent[0], 0.75 + independent[1]]
    assert await db.fetchval("SELECT rubric FROM group_rewards") == "Prefer short answers."


async def test_an_unreachable_judge_is_an_outage_not_bad_input(js, db, run_collector, nc, database_url):
    ready = await stored_ruler_group(js, db, run_collector)
    dead = f"http://127.0.0.1:{free_port()}/v1"
    service = RewardService(nc, database_url, RewardSettings(judge_api_base=dead, judge_api_key="x"))
    try:
        with pytest.raises(DependencyUnavailable, match="unavailable"):
            await service.score(ready)
    finally:
        await service.close()
    assert await db.fetchval("SELECT count(*) FROM group_rewards") == 0  # nothing decided: retried later


async def test_unknown_group_is_bad_input(nc, database_url):
    ready = GroupReady(
        id="r-1", project=PROJECT, model=MODEL, group_id="never-stored", num_trajectories=1, rewards=[0.0],
        needs_reward=True,
    )  # fmt: skip
    service = RewardService(nc, database_url, RewardSettings())
    try:
        with pytest.raises(InvalidMessage, match="no stored trajectories"):
            await service.score(ready)
    finally:
        await service.close()


async def test_artery_inference_replica_as_the_judge(stack, js, db):
    """The judge is a real inference process serving the tiny model, reached through litellm.
    The tiny random model cannot write JSON, so the outcome is known: the group is dead-lettered
    with the judge's malformed answer as the reason, after the configured attempts."""
    port = free_port()
    stack.services = ("collector", "reward")
    stack.extra_env.update(
        {
            "ARTERY_REWARD_JUDGE_MODEL": "openai/judge",
            "ARTERY_REWARD_JUDGE_API_BASE": f"http://127.0.0.1:{port}/v1",
            "ARTERY_REWARD_JUDGE_API_KEY": "judge-key",
            "ARTERY_REWARD_MAX_ATTEMPTS": "2",
        }
    )
    stack.start_services()
    inference = stack.start_service(
        "inference-judge",
        service="inference",
        env={
            "ARTERY_INFERENCE_PROJECT": PROJECT,
            "ARTERY_INFERENCE_MODEL": "judge",
            "ARTERY_INFERENCE_BASE_MODEL": "artery/tiny-random",
            "ARTERY_INFERENCE_PORT": str(port),
            "ARTERY_INFERENCE_API_KEY": "judge-key",
            "ARTERY_INFERENCE_DEFAULT_MAX_TOKENS": "32",
        },
    )
    await asyncio.to_thread(inference.wait_ready, 120)
    g = ruler_group(size=2)
    await publish_event(js, subjects.trajectories(PROJECT, MODEL), g)
    [letter] = await dead_letters(js, timeout=120)
    assert letter.kind == "ruler" and "RULER judge openai/judge failed after 2 attempts" in letter.reason
    # The replica answered (text came back and was parsed): not a connection or HTTP error.
    assert "judge answer" in letter.reason and "unavailable" not in letter.reason


async def test_trainer_never_loads_another_models_groups(js, db, run_collector):
    """Group ids in a train request are only looked up within the request's own model."""
    await run_collector()
    mine, theirs = group(PROJECT, MODEL, size=2), group("other", MODEL, size=2)
    await submit(js, run_collector, mine)
    await publish_event(js, subjects.trajectories("other", MODEL), theirs)
    await wait_for(lambda: db.fetchval("SELECT count(*) = 2 FROM trajectory_groups"))
    assert await stored_group_ids(db, PROJECT, MODEL, [mine.id, theirs.id]) == {mine.id}
    assert [len(g) for g in await load_groups(db, PROJECT, MODEL, [mine.id, theirs.id])] == [2]


async def test_concurrent_deliveries_of_a_group_call_the_judge_once(
    js, db, run_collector, nc, database_url, judge
):
    """A redelivery (ack wait passed) arriving while the first delivery still waits for a slow
    judge must wait for that verdict, not ask the judge again."""
    import time

    def slow(body: dict) -> str:
        time.sleep(0.5)  # runs in the judge server's thread
        return by_content(0.3, 0.7)(body)

    judge.answers = [slow]
    ready = await stored_ruler_group(js, db, run_collector)
    settings = RewardSettings(judge_model="openai/judge", judge_api_base=judge.api_base, judge_api_key="x")
    service = RewardService(nc, database_url, settings)
    try:
        first, second = await asyncio.gather(service.score(ready), service.score(ready))
    finally:
        await service.close()
    assert len(judge.requests) == 1
    assert first.scores == second.scores and service._group_locks == {}
