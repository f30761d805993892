"""Liveness and readiness of a service process, over HTTP and over NATS.

One rule for every service: a process is *live* while it runs, and *ready* from the moment it
logs its ``ready`` line (consumer started, engine loaded, console listening: whatever ``ready``
means for it, the same line ``artery up`` and ``Stack`` wait for) until it is asked to stop.
``shared.runtime`` wires it up, so no service repeats it:

- HTTP, on the ``/metrics`` server of every service (``ARTERY_<SERVICE>_METRICS_PORT``):
  ``GET /healthz`` is 200 while the process runs; ``GET /readyz`` is 200 once ready, 503 before
  that and while stopping. Inference and the console answer both on their own port as well.
- NATS, for a client that has nothing but NATS: while ready, the process is a NATS service
  (NATS's own service protocol, ``nats micro``) named ``artery-<service>``. ``$SRV.PING.artery-<service>``
  is answered by every ready instance (no responders: none is ready), ``$SRV.INFO.artery-<service>``
  adds each instance's ``metrics_url`` and pid, and ``$SRV.PING.artery-<service>.<id>`` asks one
  instance. The subjects are the NATS service protocol's, not Artery events, so they are not in
  the AsyncAPI contract (``shared.subjects.HEALTH_SERVICE`` names the service).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nats.micro import Service

READY_EVENT = "ready"


class Health:
    """Process-wide readiness; thread-safe (the metrics server reads it from its own threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ready = False
        self._stopping = False
        self._listeners: list[Any] = []

    @property
    def ready(self) -> bool:
        with self._lock:
            return self._ready and not self._stopping

    @property
    def stopping(self) -> bool:
        with self._lock:
            return self._stopping

    def mark_ready(self) -> None:
        with self._lock:
            if self._ready:
                return
            self._ready = True
            listeners = list(self._listeners)
        for listener in listeners:
            listener()

    def mark_stopping(self) -> None:
        with self._lock:
            self._stopping = True

    def on_ready(self, listener) -> None:
        """Call ``listener()`` once ready (at once, when it already is)."""
        with self._lock:
            already = self._ready
            if not already:
                self._listeners.append(listener)
        if already:
            listener()

    def status(self) -> tuple[int, dict]:
        """The ``/readyz`` answer: (HTTP status, body)."""
        with self._lock:
            ready, stopping = self._ready and not self._stopping, self._stopping
        state = "stopping" if stopping else ("ready" if ready else "starting")
        return (200 if ready else 503), {"ready": ready, "status": state}


#: This process's health (one service per process).
HEALTH = Health()


def note_log_event(event: object) -> None:
    """Every ``info`` line passes here (``shared.runtime``): ``ready`` marks the process ready."""
    if event == READY_EVENT:
        HEALTH.mark_ready()


def wsgi_health(app):
    """``app`` (the Prometheus WSGI app) with ``/healthz`` and ``/readyz`` in front of it."""

    def routed(environ, start_response):
        path = environ.get("PATH_INFO", "")
        if path in ("/healthz", "/readyz"):
            status, body = (200, {"status": "ok"}) if path == "/healthz" else HEALTH.status()
            data = json.dumps(body).encode()
            start_response(
                f"{status} {'OK' if status == 200 else 'Service Unavailable'}",
                [("Content-Type", "application/json"), ("Content-Length", str(len(data)))],
            )
            return [data]
        return app(environ, start_response)

    return routed


class NatsReadiness:
    """The NATS side: a NATS service named ``name`` on ``nc`` while the process is ready."""

    def __init__(self, nc, name: str, metadata: dict[str, str]) -> None:
        self.nc = nc
        self.name = name
        self.metadata = metadata
        self._service: Service | None = None

    async def start(self) -> None:
        from nats import micro

        self._service = await micro.add_service(
            self.nc,
            name=self.name,
            version=_version(),
            description="an Artery service: present while ready",
            metadata=self.metadata,
        )

    async def stop(self) -> None:
        if self._service is not None:
            with contextlib.suppress(Exception):  # the connection may be closing already
                await self._service.stop()
            self._service = None


def _version() -> str:
    """The NATS service protocol wants a semantic version; a dev build's ``0.1.0.dev3`` is not."""
    try:
        version = importlib.metadata.version("artery")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that is not installed
        version = "0.0.0"
    parts = [*version.split("+")[0].split("."), "0", "0"][:3]
    return ".".join(p if p.isdigit() else "0" for p in parts)
