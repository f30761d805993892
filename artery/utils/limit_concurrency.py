"""``limit_concurrency``: at most ``n`` calls of an async function at once (per key)."""

from __future__ import annotations

import asyncio
import functools
import weakref
from collections.abc import Callable, Hashable
from typing import Any


def limit_concurrency(n: int, derive_key: Callable[..., Hashable] | None = None):
    """Decorate an async function so that at most ``n`` of its calls run at once.

    As ART's: with ``derive_key``, the limit is per key, ``derive_key(*args, **kwargs)`` of each
    call (e.g. per API host); without it, one limit for all calls. Semaphores are kept per event
    loop, so the decorated function also works across ``asyncio.run`` calls.
    """
    if n < 1:
        raise ValueError("n must be at least 1")

    def decorate(fn: Callable[..., Any]):
        per_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[Hashable, asyncio.Semaphore]]
        per_loop = weakref.WeakKeyDictionary()

        @functools.wraps(fn)
        async def wrapper(*args, **kwargs):
            key = derive_key(*args, **kwargs) if derive_key is not None else "default"
            semaphores = per_loop.setdefault(asyncio.get_running_loop(), {})
            semaphore = semaphores.get(key)
            if semaphore is None:
                semaphore = semaphores[key] = asyncio.Semaphore(n)
            async with semaphore:
                return await fn(*args, **kwargs)

        return wrapper

    return decorate
