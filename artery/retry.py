"""``art.retry``: exponential back-off for sync or async functions, as in ART."""

from __future__ import annotations

import asyncio
import functools
import inspect
import time
from collections.abc import Callable


def retry(
    max_attempts: int = 3,
    delay: float = 0.25,
    backoff_factor: float = 2.0,
    exceptions: tuple[type[BaseException], ...] = (Exception,),
    on_retry: Callable[[BaseException, int], object] | None = None,
):
    """Retry the decorated function up to ``max_attempts`` times on ``exceptions``.

    The wait before attempt ``n + 1`` is ``delay * backoff_factor ** (n - 1)``; ``on_retry`` is
    called with the exception and the attempt number that failed.
    """
    if max_attempts < 1:
        raise ValueError("max_attempts must be at least 1")

    def decorate(fn):
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def async_wrapper(*args, **kwargs):
                for attempt in range(1, max_attempts + 1):
                    try:
                        return await fn(*args, **kwargs)
                    except exceptions as exc:
                        if attempt == max_attempts:
                            raise
                        if on_retry is not None:
                            on_retry(exc, attempt)
                        await asyncio.sleep(delay * backoff_factor ** (attempt - 1))

            return async_wrapper

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            for attempt in range(1, max_attempts + 1):
                try:
                    return fn(*args, **kwargs)
                except exceptions as exc:
                    if attempt == max_attempts:
                        raise
                    if on_retry is not None:
                        on_retry(exc, attempt)
                    time.sleep(delay * backoff_factor ** (attempt - 1))

        return wrapper

    return decorate
