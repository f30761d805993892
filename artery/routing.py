"""Spreading a model's completion requests over its live replicas, and following them.

Without a fixed ``ARTERY_INFERENCE_URL``, replicas are found in the registry
(``live_replicas``). One URL chosen at ``register()`` would send every request to one replica,
and break when that replica moves or dies. Instead each request goes to the next live replica,
round robin, among those serving the model name it asks for (``agent@3`` only where step 3 is
loaded). The list is read again every few seconds, and at once when a replica refuses the
connection; the request then goes to another replica (nothing was sent, so nothing is repeated).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Awaitable, Callable

import httpx

from artery.schemas import ReplicaInfo

Replicas = Callable[[], Awaitable[list[ReplicaInfo]]]
#: How long a read of the registry is used before the next one.
REFRESH_S = 5.0
#: How long a read of the registry is used before the next one.
REFRESH_S = 5.0


class ReplicaRouter(httpx.AsyncBaseTransport):
    """An httpx transport that sends each request to a live replica of the model.

    ``base_path`` is the path of the client's base URL (``/v1``): what follows it in a request's
    path is appended to the chosen replica's URL plus ``base_path``.
    """

    def __init__(
        self,
        inner: httpx.AsyncBaseTransport,
        replicas: Replicas,
        *,
        base_path: str,
        refresh_s: float | None = None,
    ):
        self.inner = inner
        self.read_replicas = replicas
        self.base_path = base_path.rstrip("/")
        self.refresh_s = REFRESH_S if refresh_s is None else refresh_s
        self._replicas: list[ReplicaInfo] = []
        self._read_at = float("-inf")
        self._turn = itertools.count()
        self._reading = asyncio.Lock()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        wanted = _requested_model(request)
        refused: set[str] = set()
        while True:
            replica = await self._pick(wanted, refused)
            if replica is None:
                detail = f" of {sorted(refused)}" if refused else ""
                raise httpx.ConnectError(
                    f"no live replica serves {wanted or 'this model'}{detail}", request=request
                )
            try:
                return await self.inner.handle_async_request(self._routed(request, replica))
            except httpx.ConnectError:
                refused.add(replica.replica_id)  # dead or moved: read the registry again
                self._read_at = float("-inf")

    async def aclose(self) -> None:
        await self.inner.aclose()

    async def _pick(self, wanted: str | None, refused: set[str]) -> ReplicaInfo | None:
        await self._refresh()
        live = [r for r in self._replicas if r.replica_id not in refused]
        serving = [r for r in live if wanted in r.served] if wanted else []
        # A name no replica lists yet (an adapter still loading) is left to a replica to answer.
        candidates = serving or live
        return candidates[next(self._turn) % len(candidates)] if candidates else None

    async def _refresh(self) -> None:
        """Read the registry when the last read is older than ``refresh_s``: once, however many
        requests (a whole group of rollouts) find it old at the same moment."""
        if time.monotonic() - self._read_at <= self.refresh_s:
            return
        async with self._reading:
            if time.monotonic() - self._read_at > self.refresh_s:
                self._replicas = sorted(await self.read_replicas(), key=lambda r: r.replica_id)
                self._read_at = time.monotonic()

    def _routed(self, request: httpx.Request, replica: ReplicaInfo) -> httpx.Request:
        path = request.url.raw_path.decode("ascii")
        suffix = path[len(self.base_path) :] if path.startswith(self.base_path) else path
        url = httpx.URL(replica.url.rstrip("/") + self.base_path + suffix)
        headers = request.headers.copy()
        headers["host"] = url.netloc.decode("ascii")
        return httpx.Request(
            request.method, url, headers=headers, stream=request.stream, extensions=request.extensions
        )


def _requested_model(request: httpx.Request) -> str | None:
    """The ``model`` of a JSON request body (the OpenAI API's requests carry one)."""
    if request.method != "POST" or "json" not in request.headers.get("content-type", ""):
        return None
    try:
        model = json.loads(request.read()).get("model")
    except (ValueError, AttributeError):
        return None
    return model if isinstance(model, str) else None
