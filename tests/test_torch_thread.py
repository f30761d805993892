"""The trainer's torch thread (``services/trainer/torch_thread.py``): every call on one thread,
in the order asked, with the caller's context; refused once closed."""

from __future__ import annotations

import asyncio
import contextvars
import threading

import pytest

from artery.services.trainer.torch_thread import TorchThread

TRACE = contextvars.ContextVar("trace", default="none")


async def test_every_call_runs_on_one_thread_that_is_not_the_loops():
    thread = TorchThread()
    try:
        seen = {await thread.run(threading.get_ident) for _ in range(5)}
        # Calls asked together still share it: none of them starts a second thread.
        together = await asyncio.gather(*(thread.run(threading.get_ident) for _ in range(5)))
    finally:
        thread.close()
    assert len(seen | set(together)) == 1
    assert seen != {threading.get_ident()}


async def test_calls_run_in_the_order_asked_each_to_its_end_before_the_next():
    thread = TorchThread()
    order: list[str] = []
    loop = asyncio.get_running_loop()
    first_started, first_may_end = asyncio.Event(), threading.Event()

    def first() -> None:
        order.append("first started")
        loop.call_soon_threadsafe(first_started.set)
        first_may_end.wait()
        order.append("first ended")

    try:
        running = asyncio.ensure_future(thread.run(first))
        second = asyncio.ensure_future(thread.run(order.append, "second"))
        # The second is queued behind the first, which holds the thread until it is let go.
        await first_started.wait()
        assert order == ["first started"]
        first_may_end.set()
        await asyncio.gather(running, second)
    finally:
        thread.close()
    assert order == ["first started", "first ended", "second"]


async def test_the_callers_context_goes_with_the_call():
    thread = TorchThread()
    TRACE.set("step 3")
    try:
        assert await thread.run(TRACE.get) == "step 3"
    finally:
        thread.close()


async def test_a_closed_thread_refuses_calls():
    thread = TorchThread()
    thread.close()
    with pytest.raises(RuntimeError):
        await thread.run(threading.get_ident)
