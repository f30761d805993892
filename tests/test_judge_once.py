"""A paid judge call is never repeated: the verdict outlives a SIGKILL of the reward service
between the judge's answer and the row (real processes: collector and reward as child processes,
a real nats-server, PostgreSQL and an HTTP judge). The PostgreSQL-outage version is
``test_db_faults.py::test_reward_service_waits_out_postgres_and_judges_each_group_once``."""

from __future__ import annotations

import asyncio

import asyncpg
import msgspec
import pytest
from nats.js.errors import KeyNotFoundError

from artery.schemas import GroupScored
from artery.services.reward.verdicts import JudgedGroup, verdict_key
from artery.shared import subjects
from artery.shared.bus import publish_event
from artery.testing.judge import serve_scripted_judge
from tests.helpers import wait_for
from tests.test_reward_service import MODEL, PROJECT, by_content, ruler_group, scored_events

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]


async def test_sigkill_after_the_judge_answered_never_calls_it_again(stack, js, db, database_url):
    with serve_scripted_judge() as judge:
        judge.answers = [by_content(0.3, 0.9)]
        stack.services = ("collector", "reward")
        stack.extra_env.update(
            {
                "ARTERY_REWARD_JUDGE_MODEL": "openai/judge",
                "ARTERY_REWARD_JUDGE_API_BASE": judge.api_base,
                "ARTERY_REWARD_JUDGE_API_KEY": "x",
                # The killed delivery comes back soon after the restart, not in five minutes.
                "ARTERY_REWARD_ACK_WAIT_S": "2",
                "ARTERY_REWARD_FETCH_TIMEOUT_S": "0.1",
            }
        )
        await asyncio.to_thread(stack.start_services)
        # The verdict's row cannot be written (reads still can): the service is held between
        # the judge's answer and PostgreSQL, where a SIGKILL loses everything held in memory.
        blocker = await asyncpg.connect(database_url)
        blocking = blocker.transaction()
        await blocking.start()
        await blocker.execute("LOCK TABLE group_rewards IN EXCLUSIVE MODE")

        g = ruler_group(size=2)
        await publish_event(js, subjects.trajectories(PROJECT, MODEL), g)
        verdicts = await js.key_value(subjects.VERDICTS_BUCKET)
        key = verdict_key(PROJECT, MODEL, g.id)

        async def kept():
            try:
                return msgspec.json.decode((await verdicts.get(key)).value, type=JudgedGroup)
            except KeyNotFoundError:
                return None

        judged = await wait_for(kept, timeout=60)
        assert len(judge.requests) == 1 and judged.verdict.error is None
        await asyncio.to_thread(stack.kill_service, "reward")
        await blocking.rollback()
        await blocker.close()
        assert await db.fetchval("SELECT count(*) FROM group_rewards") == 0

        await asyncio.to_thread(stack.restart_service, "reward")
        [scored] = await scored_events(js, timeout=60)
        assert len(judge.requests) == 1, "the judge was paid twice for one group"
        assert [s.judge_score for s in scored.scores] == [0.3, 0.9]
        assert isinstance(scored, GroupScored) and scored.group_id == g.id
        assert await db.fetchval("SELECT count(*) FROM trajectory_rewards") == 2
