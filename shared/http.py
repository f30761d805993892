"""An HTTP server inside a service's event loop (uvicorn), on a port of its choosing or ours."""

from __future__ import annotations

import asyncio
import contextlib

import uvicorn


async def serve_http(app, host: str, port: int) -> tuple[uvicorn.Server, asyncio.Task, int]:
    """Start ``app`` on ``host:port`` (0: a free port); return the server, its task and the port."""
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off"))
    server.install_signal_handlers = lambda: None  # our runtime owns SIGTERM/SIGINT
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()  # raises the reason it could not start (port taken, ...)
        await asyncio.sleep(0.02)
    return server, task, server.servers[0].sockets[0].getsockname()[1]


async def stop_http(server: uvicorn.Server, task: asyncio.Task, grace_s: float = 3.0) -> None:
    """Ask it to stop; cut what is still open (event streams never end by themselves) after ``grace_s``."""
    server.should_exit = True
    try:
        await asyncio.wait_for(asyncio.shield(task), timeout=grace_s)
    except TimeoutError:
        server.force_exit = True
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
