"""Publishing until acked: an unacked publish is sent again unchanged and stored once."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from nats.errors import NoRespondersError
from nats.js.errors import NoStreamResponseError

import artery as art
from artery.shared import bus, subjects
from artery.shared.bus import prepare, publish_until_acked
from tests.factories import group


async def test_messages_without_an_ack_are_sent_again_and_stored_once(nats_server, common_settings):
    """No stream listens at first (every publish fails unacked); the stream appears while the
    publisher retries; every message ends up stored exactly once."""
    nc = await bus.connect(common_settings, name="retry-test")
    js = nc.jetstream()
    try:
        groups = [group(seed=i) for i in range(20)]
        # On a services' stream: those agents write to keep JetStream's de-duplication at its
        # 100 ms minimum and are idempotent in PostgreSQL instead (test_tenants.py).
        messages = [prepare(subjects.group_ready("demo", "agent"), g) for g in groups]

        async def provision_later():
            await asyncio.sleep(0.6)
            await bus.provision(js, common_settings)

        provisioning = asyncio.create_task(provision_later())
        acks = await publish_until_acked(js, messages, attempts=8, delay_s=0.2)
        await provisioning
        # One ack per message, each its own stored message. Not in the messages' order: the
        # stream can appear while a round is in flight, and the messages sent before it are
        # stored in the next round, after those sent just after it.
        assert len(acks) == 20 and len({a.seq for a in acks}) == 20
        # Publishing the same messages again (a caller's retry) stores nothing new.
        again = await publish_until_acked(js, messages)
        assert all(a.duplicate for a in again)
        info = await js.stream_info(subjects.GROUPS.name)
        assert info.state.messages == 20
    finally:
        await nc.close()


async def test_gives_up_with_the_last_error(nats_server, common_settings):
    nc = await bus.connect(common_settings, name="retry-test")
    try:
        message = prepare(subjects.trajectories("demo", "agent"), group())
        with pytest.raises((NoRespondersError, NoStreamResponseError)):  # publish_async reports either
            await publish_until_acked(nc.jetstream(), [message], attempts=2, delay_s=0.05)
    finally:
        await nc.close()


def test_a_group_keeps_its_event_id_across_calls():
    g = art.TrajectoryGroup([art.Trajectory(messages_and_choices=[{"role": "user", "content": "hi"}])])
    first = g.to_event(project="demo", model="agent")
    assert g.to_event(project="demo", model="agent").id == first.id
    other = art.TrajectoryGroup([art.Trajectory(messages_and_choices=[{"role": "user", "content": "hi"}])])
    assert other.to_event(project="demo", model="agent").id != first.id


def test_a_group_sent_again_unchanged_is_the_same_event_even_after_the_step_moved():
    """ART's ``model.log(groups, step=result.step, split="train")`` after ``train()`` publishes the
    trained groups again at a later step: the same bytes, so the collector sees a redelivery."""
    g = art.TrajectoryGroup([art.Trajectory(messages_and_choices=[{"role": "user", "content": "hi"}])])
    first = g.to_event(project="demo", model="agent", step=0, split="train")
    again = g.to_event(project="demo", model="agent", step=1, split="train")
    assert msgspec.json.encode(again) == msgspec.json.encode(first)
    g.trajectories[0].reward = 1.0  # changed since: a new body under the same id (a conflict)
    changed = g.to_event(project="demo", model="agent", step=1, split="train")
    assert changed.id == first.id and changed.trajectories[0].reward == 1.0 and changed.step == 1
