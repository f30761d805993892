"""An embedded NATS cluster on loopback: ``size`` nats-server processes with JetStream, joined by
routes, each with its own store; one node can be killed and restarted (same ports, same store).

For tests and local experiments with replicated streams (``ARTERY_STREAM_REPLICAS=3``): the
nodes are ordinary :class:`~artery.shared.embedded.NatsServer` processes whose configuration adds
a server name, a cluster block and a monitoring port (``/healthz`` says when JetStream is ready).
"""

from __future__ import annotations

import json
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

from artery.shared.embedded import NatsServer, free_port

READY_TIMEOUT_S = 30.0


class ClusterNode(NatsServer):
    """One member of a :class:`NatsCluster`."""

    def __init__(self, store_dir: Path, *, name: str, cluster_port: int, http_port: int, **kwargs):
        super().__init__(store_dir, **kwargs)
        self.name = name
        self.cluster_port = cluster_port
        self.http_port = http_port

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def health(self) -> dict:
        """The node's ``/healthz`` answer (``{"status": "ok"}`` once JetStream is current)."""
        return self._monitor("healthz")

    def meta_leader(self) -> str | None:
        """The JetStream meta leader this node knows of (``/jsz``), None while there is none."""
        return (self._monitor("jsz").get("meta_cluster") or {}).get("leader")

    def _monitor(self, endpoint: str) -> dict:
        url = f"http://127.0.0.1:{self.http_port}/{endpoint}"
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:  # 503 with a reason while JetStream catches up
            try:
                return json.loads(exc.read() or b"{}")
            except ValueError:
                return {"status": "unavailable", "error": f"HTTP {exc.code}"}
        except OSError as exc:  # not listening (yet)
            return {"status": "unavailable", "error": repr(exc)}


class NatsCluster:
    """``size`` clustered nats-servers under ``root`` (``root/<name>/`` each), JetStream on all."""

    def __init__(
        self,
        root: Path,
        size: int = 3,
        *,
        cluster_name: str = "artery",
        max_payload: int = 8 * 1024 * 1024,
        extra_config: str = "",
    ):
        if size < 1:
            raise ValueError("a cluster needs at least one node")
        self.root = Path(root)
        self.cluster_name = cluster_name
        cluster_ports = [free_port() for _ in range(size)]
        routes = ", ".join(f"nats-route://127.0.0.1:{p}" for p in cluster_ports)
        self.nodes: list[ClusterNode] = []
        for i, cluster_port in enumerate(cluster_ports):
            name = f"n{i + 1}"
            http_port = free_port()
            config = (
                f"server_name: {name}\n"
                f"http: 127.0.0.1:{http_port}\n"
                f"cluster {{\n  name: {cluster_name}\n  listen: 127.0.0.1:{cluster_port}\n"
                f"  routes: [{routes}]\n}}\n"
                f"{extra_config}\n"
            )
            self.nodes.append(
                ClusterNode(
                    self.root / name,
                    name=name,
                    cluster_port=cluster_port,
                    http_port=http_port,
                    max_payload=max_payload,
                    extra_config=config,
                )
            )

    @property
    def urls(self) -> list[str]:
        return [node.url for node in self.nodes]

    @property
    def url(self) -> str:
        """Every node's client URL, comma-separated (what ``ARTERY_NATS_URL`` takes)."""
        return ",".join(self.urls)

    def node(self, name: str) -> ClusterNode:
        return next(n for n in self.nodes if n.name == name)

    def start(self, timeout: float = READY_TIMEOUT_S) -> NatsCluster:
        for node in self.nodes:
            node.start()
        self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Until every running node reports JetStream healthy (a meta leader elected, caught up)."""
        deadline = time.monotonic() + timeout
        pending = [n for n in self.nodes if n.running]
        while pending:
            pending = [n for n in pending if not _ready(n)]
            if not pending:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"nodes {[n.name for n in pending]} not healthy within {timeout}s")
            time.sleep(0.1)

    def kill(self, name: str) -> None:
        """SIGKILL one node: no goodbye to its clients or its peers."""
        self.node(name).stop(signal.SIGKILL)

    def restart(self, name: str, timeout: float = READY_TIMEOUT_S) -> None:
        """Start a stopped node again on its ports with its store; wait until it is healthy."""
        node = self.node(name)
        node.start()
        deadline = time.monotonic() + timeout
        while not _ready(node):
            if time.monotonic() > deadline:
                raise TimeoutError(f"node {name} not healthy within {timeout}s after restart")
            time.sleep(0.1)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> NatsCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _ready(node: ClusterNode) -> bool:
    return node.health().get("status") == "ok" and node.meta_leader() is not None
