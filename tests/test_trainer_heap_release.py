"""The trainer's freed heap goes back to the OS once no step has run for a while, not after each
step: back-to-back steps reuse it instead of faulting it back in page by page."""

from __future__ import annotations

import threading

import pytest

from artery.services.trainer.memory import IdleHeapRelease

#: Long enough that no test waits it out: a release that happens is one the test asked for.
NEVER_S = 3600.0


class Releases:
    def __init__(self) -> None:
        self.count = 0
        self.done = threading.Event()

    def __call__(self) -> None:
        self.count += 1
        self.done.set()


def test_an_idle_trainer_releases_its_freed_heap_once():
    releases = Releases()
    heap = IdleHeapRelease(idle_s=0.01, release=releases)
    heap.idle()
    assert releases.done.wait(timeout=30)
    assert releases.count == 1
    assert not heap.pending()


def test_a_step_that_starts_within_the_idle_time_keeps_the_heap():
    releases = Releases()
    heap = IdleHeapRelease(idle_s=NEVER_S, release=releases)
    heap.idle()
    assert heap.pending()
    heap.busy()
    assert not heap.pending()
    assert releases.count == 0


def test_each_step_restarts_the_idle_time_and_a_failed_step_still_ends_it():
    releases = Releases()
    heap = IdleHeapRelease(idle_s=NEVER_S, release=releases)
    with heap.step():
        assert not heap.pending()  # never released under a running step
    assert heap.pending()
    with pytest.raises(RuntimeError), heap.step():
        raise RuntimeError("a cancelled or failed step")
    assert heap.pending()  # its activations were freed all the same
    heap.busy()
    assert releases.count == 0
