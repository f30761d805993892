"""The console's queries against a real PostgreSQL, on what agents really store."""

from __future__ import annotations

from artery.schemas import Message, Trajectory, TrajectoryGroupSubmitted, new_event_id
from artery.services.collector.store import StoredGroup, write_groups
from artery.services.console import queries


async def test_the_trajectory_list_reads_a_conversation_holding_a_nul_character(db):
    """A model can sample a NUL token (the tiny random model sometimes does): the json column
    keeps it as \\u0000, which PostgreSQL's json operators refuse to read ("unsupported Unicode
    escape sequence"). The list must still show the trajectory, with its message count."""
    texts = ["a NUL \x00 sampled", "a literal backslash-u: \\u0000", "plain"]
    group = TrajectoryGroupSubmitted(
        id=new_event_id(),
        project="p",
        model="m",
        split="val",
        trajectories=[
            Trajectory(
                messages=[Message(role="user", content="q"), Message(role="assistant", content=text)],
                reward=r,
            )
            for r, text in enumerate(texts)
        ],
    )
    await write_groups(db, [StoredGroup.of(group, None)])
    rows = await queries.trajectories(db, "p", "m")
    assert sorted((r["idx"], r["messages"], r["split"]) for r in rows) == [(i, 2, "val") for i in range(3)]
    shown = await queries.trajectory(db, "p", "m", group.id, 0)
    assert shown["body"]["messages"][1]["content"] == texts[0]  # the whole body, NUL and all
