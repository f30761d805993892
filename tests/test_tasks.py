"""Stopping helper tasks (``shared.tasks``) without swallowing the caller's own cancellation, and
the trainer step that waits for its save before an error goes on."""

from __future__ import annotations

import asyncio

import pytest

from artery.shared.tasks import cancel_and_wait, settled


async def _forever() -> None:
    await asyncio.Event().wait()


class SlowToStop:
    """A task that takes its time to end once cancelled (a heartbeat finishing a request)."""

    def __init__(self) -> None:
        self.stopping = asyncio.Event()
        self.may_end = asyncio.Event()
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.stopping.set()
            await self.may_end.wait()
            raise


async def test_the_helper_is_cancelled_and_awaited():
    task = asyncio.create_task(_forever())
    await asyncio.sleep(0)  # it runs up to its wait
    await cancel_and_wait(task)
    assert task.cancelled()


async def test_a_helper_that_fails_on_its_way_out_raises_its_error():
    async def fails_when_cancelled() -> None:
        try:
            await _forever()
        except asyncio.CancelledError:
            raise RuntimeError("lost the last heartbeat") from None

    task = asyncio.create_task(fails_when_cancelled())
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="last heartbeat"):
        await cancel_and_wait(task)


async def test_a_helper_that_had_ended_is_left_as_it_ended():
    task = asyncio.create_task(asyncio.sleep(0, result=7))
    await task
    await cancel_and_wait(task)
    assert task.result() == 7


async def test_the_callers_cancellation_during_the_wait_is_not_swallowed():
    helper = SlowToStop()
    after_wait: list[str] = []

    async def stop_then_go_on() -> None:
        await cancel_and_wait(helper.task)
        after_wait.append("went on")

    caller = asyncio.create_task(stop_then_go_on())
    await helper.stopping.wait()  # the caller waits for the helper to end
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    # The old idiom (suppress(CancelledError) around the await) took the caller's cancellation
    # for the helper's and went on.
    assert after_wait == []
    assert helper.task.done()


async def test_cleanup_that_runs_because_the_caller_is_cancelled_still_finishes():
    helper = SlowToStop()
    cleaned: list[str] = []
    started = asyncio.Event()

    async def work_then_clean_up() -> None:
        try:
            started.set()
            await _forever()
        finally:  # runs with the caller's cancellation pending
            await cancel_and_wait(helper.task)
            cleaned.append("heartbeat stopped")

    caller = asyncio.create_task(work_then_clean_up())
    await started.wait()
    caller.cancel()
    await helper.stopping.wait()
    helper.may_end.set()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert cleaned == ["heartbeat stopped"]


async def test_settled_waits_for_unstoppable_work_and_returns_its_failure():
    ended: list[str] = []

    def save() -> None:
        ended.append("saved")
        raise OSError("disk full")

    saving = asyncio.ensure_future(asyncio.to_thread(save))
    failure = await settled(saving)
    assert isinstance(failure, OSError) and ended == ["saved"]
    assert await settled(asyncio.ensure_future(asyncio.to_thread(ended.append, "again"))) is None
