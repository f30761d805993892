"""``art.trajectory_group_batches``: groups in batches as they finish, with bounded concurrency.

As ART's: up to ``batch_size * max_concurrent_batches`` groups run at once; each batch is the
first ``batch_size`` groups to finish (in finishing order), so training on one batch overlaps
the rollouts of the next. The progress bar and exception accounting are a ``GatherContext``'s,
started again for each batch: ``max_batch_exceptions`` applies per batch.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
from collections.abc import AsyncIterator, Awaitable, Iterable

from artery.gather_context import GatherContext, TooManyExceptions, _current
from artery.trajectories import TrajectoryGroup
from artery.unstarted import close_unstarted


async def trajectory_group_batches(
    groups: Iterable[Awaitable[TrajectoryGroup]],
    *,
    batch_size: int,
    max_batch_exceptions: int | float = 0,
    max_concurrent_batches: int = 4,
    skip_batches: int = 0,
    pbar_desc: str | None = "batches",
) -> AsyncIterator[list[TrajectoryGroup]]:
    """Yield lists of ``batch_size`` finished groups (the last one may be shorter).

    ``groups`` is read lazily: a group is created (a generator's next item) only when there is
    room for it. The first ``batch_size * skip_batches`` groups are skipped without being run
    (resuming). A group that raises counts as one exception and is left out; more exceptions in
    one batch than ``max_batch_exceptions`` (a count, or a fraction of a batch's rollouts when
    ``0 < x < 1``) raise ``TooManyExceptions``. Leaving the loop early leaves groups running
    until the generator is closed: ``async with contextlib.aclosing(...)`` closes it at once.
    """
    if batch_size < 1:
        raise ValueError("batch_size must be at least 1")
    if max_concurrent_batches < 1:
        raise ValueError("max_concurrent_batches must be at least 1")
    if skip_batches < 0:
        raise ValueError("skip_batches must be >= 0")
    unstarted = iter(groups)
    # never run: no "coroutine was never awaited" warning
    close_unstarted(itertools.islice(unstarted, batch_size * skip_batches))
    context = GatherContext(pbar_desc, max_batch_exceptions, window_groups=batch_size)
    # The groups report to this context; the caller's own context is left as it was.
    group_context = contextvars.copy_context()
    group_context.run(_current.set, context)

    async def run(awaitable: Awaitable[TrajectoryGroup]) -> TrajectoryGroup | None:
        try:
            return await awaitable
        except TooManyExceptions:
            raise
        except Exception as exc:
            context.record_exception(exc)  # raises once the batch has too many
            return None

    limit = batch_size * max_concurrent_batches
    pending: set[asyncio.Task[TrajectoryGroup | None]] = set()
    created: list[Awaitable[TrajectoryGroup]] = []  # closed at the end if they never started
    batch: list[TrajectoryGroup] = []
    exhausted = False
    try:
        while True:
            while not exhausted and len(pending) < limit:
                awaitable = next(unstarted, None)
                if awaitable is None:
                    exhausted = True
                    break
                # Each group in its own copy: its spans and context variables stay its own.
                pending.add(asyncio.create_task(run(awaitable), context=group_context.copy()))
                created.append(awaitable)
            if not pending:
                break
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                group = task.result()
                if group is not None:
                    batch.append(group)
            while len(batch) >= batch_size:
                ready, batch = batch[:batch_size], batch[batch_size:]
                context.reset()
                yield ready
        if batch:
            yield batch
    finally:
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        close_unstarted(created)  # a task cancelled before it ran never awaited its group
        if context.done == 0:
            context.pbar.leave = False  # the bar opened after the last batch: nothing to show
        context.close()
