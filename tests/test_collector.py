"""The collector against a real nats-server and PostgreSQL."""

from __future__ import annotations

import msgspec

from artery.schemas import GroupReady
from artery.shared import subjects
from artery.shared.bus import publish_event
from tests.factories import group


async def test_group_is_stored_and_announced(js, db, run_collector):
    ready_sub = await js.subscribe(subjects.group_ready("demo", "agent"))
    await run_collector()
    g = group(size=4)
    await publish_event(js, subjects.trajectories("demo", "agent"), g)

    msg = await ready_sub.next_msg(timeout=10)
    ready = msgspec.json.decode(msg.data, type=GroupReady)
    assert ready.group_id == g.id
    assert ready.rewards == [0.0, 0.25, 0.5, 0.75]
    row = await db.fetchrow("SELECT * FROM trajectory_groups WHERE id = $1", g.id)
    assert row["num_trajectories"] == 4 and row["split"] == "train"
    assert await db.fetchval("SELECT count(*) FROM trajectories WHERE group_id = $1", g.id) == 4
    body = await db.fetchval("SELECT body FROM trajectories WHERE group_id = $1 AND idx = 2", g.id)
    assert body["reward"] == 0.5 and len(body["messages"]) == 10


def test_reward_mean_of_huge_finite_rewards_stays_finite():
    import math

    from artery.services.collector.store import reward_mean

    assert reward_mean([1e308, 1e308]) == 1e308 and math.isfinite(reward_mean([1.7e308, 1.7e308, -1e308]))
    assert reward_mean([0.0, 1.0, 0.5]) == 0.5
