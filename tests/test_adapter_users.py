"""``AdapterUsers``: the vLLM engine removes an adapter only once no running request uses it
(the engine itself, under a deletion mid-stream: ``test_engine_vllm.py``)."""

from __future__ import annotations

import asyncio

import pytest

from artery.services.inference.engine.adapter_users import AdapterUsers


async def test_finished_waits_for_every_running_request_of_that_adapter_only():
    users = AdapterUsers()
    first, second, other = users.using(1), users.using(1), users.using(2)
    for request in (first, second, other):
        request.__enter__()
    waiter = asyncio.create_task(users.finished(1))
    await asyncio.sleep(0)
    assert users.running(1) == 2 and not waiter.done()
    first.__exit__(None, None, None)
    await asyncio.sleep(0)
    assert not waiter.done()  # one request of adapter 1 still runs
    second.__exit__(None, None, None)
    await asyncio.wait_for(waiter, timeout=5)  # adapter 2's request does not hold it
    assert users.running(1) == 0 and users.running(2) == 1
    other.__exit__(None, None, None)


async def test_an_unused_adapter_is_finished_at_once_and_no_adapter_is_not_counted():
    users = AdapterUsers()
    await asyncio.wait_for(users.finished(7), timeout=5)
    with users.using(None):
        assert users.running(None) == 0


async def test_a_request_that_fails_still_releases_its_adapter():
    users = AdapterUsers()
    with pytest.raises(RuntimeError), users.using(3):
        raise RuntimeError("the engine refused the request")
    assert users.running(3) == 0
    await asyncio.wait_for(users.finished(3), timeout=5)


async def test_an_adapter_used_again_after_it_was_idle_is_waited_for_again():
    users = AdapterUsers()
    with users.using(4):
        pass
    again = users.using(4)
    again.__enter__()
    waiter = asyncio.create_task(users.finished(4))
    await asyncio.sleep(0)
    assert not waiter.done()
    again.__exit__(None, None, None)
    await asyncio.wait_for(waiter, timeout=5)
