"""Installs the HTTP hooks, once per process, on the first scope."""

from __future__ import annotations

import threading

from artery.capture import hook_aiohttp, hook_httpx, hook_requests

_lock = threading.Lock()
_installed = False


def install() -> None:
    global _installed
    with _lock:
        if _installed:
            return
        hook_httpx.install()
        hook_aiohttp.install()
        hook_requests.install()
        _installed = True
