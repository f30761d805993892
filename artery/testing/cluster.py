"""An embedded NATS cluster on loopback: ``size`` nats-server processes with JetStream, joined by
routes, each with its own store; one node can be killed and restarted (same ports, same store).

For tests and local experiments with replicated streams (``ARTERY_STREAM_REPLICAS=3``): the
nodes are ordinary :class:`~artery.shared.embedded.NatsServer` processes whose configuration adds
a server name, a cluster block and a monitoring port (``/healthz`` says when JetStream is ready).

Ports: nodes bind ports of their own choosing and report them (see ``shared.embedded``), except
the first node's cluster port. Clustered JetStream will not start without a route, and before any
node runs the only route there can be is the first node's route to itself: that port is picked
ahead and, if taken meanwhile, picked again. Each later node routes to the nodes already running;
gossip completes the mesh. Once up, every node routes to every other, so a restarted node finds
its peers on the ports it had.
"""

from __future__ import annotations

import json
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from pathlib import Path

from artery.shared.embedded import (
    PORT_ATTEMPTS,
    NatsServer,
    PortInUseError,
    config_port,
    free_port,
    port_of,
)

READY_TIMEOUT_S = 30.0


class ClusterNode(NatsServer):
    """One member of a :class:`NatsCluster`; a port left None is bound by the server (on start)."""

    def __init__(
        self,
        store_dir: Path,
        *,
        name: str,
        cluster_name: str,
        cluster_port: int | None = None,
        http_port: int | None = None,
        routes: list[int] | None = None,
        **kwargs,
    ):
        super().__init__(store_dir, **kwargs)
        self.name = name
        self.cluster_name = cluster_name
        self.cluster_port = cluster_port
        self.http_port = http_port
        #: Cluster ports of the peers it connects to (its own is ignored by the server).
        self.routes = list(routes or [])

    @property
    def label(self) -> str:
        return f"nats-server {self.name}"

    def _base_config(self) -> str:
        routes = ", ".join(f"nats-route://127.0.0.1:{port}" for port in self.routes)
        return super()._base_config() + (
            f"server_name: {self.name}\n"
            f"http: 127.0.0.1:{config_port(self.http_port)}\n"
            f"cluster {{\n  name: {self.cluster_name}\n"
            f"  listen: 127.0.0.1:{config_port(self.cluster_port)}\n"
            f"  routes: [{routes}]\n}}\n"
        )

    def _take_ports(self, ports: dict[str, list[str]]) -> None:
        super()._take_ports(ports)
        self.http_port = port_of(ports["monitoring"][0])
        self.cluster_port = port_of(ports["cluster"][0])

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
        self.nodes = [
            ClusterNode(
                self.root / f"n{i + 1}",
                name=f"n{i + 1}",
                cluster_name=cluster_name,
                max_payload=max_payload,
                extra_config=extra_config,
            )
            for i in range(size)
        ]

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
        """Every node, then until JetStream is healthy; on failure the nodes started are stopped."""
        try:
            for node in self.nodes:
                self._start_node(node)
            # From now on each node knows every peer: a restarted one rejoins whoever is up.
            for node in self.nodes:
                node.routes = _cluster_ports(self.nodes)
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_node(self, node: ClusterNode) -> None:
        """Start ``node`` routed to the nodes already up, or to itself if none is (module doc)."""
        if node.cluster_port is not None:  # started before: same ports, routes to every peer
            node.start()
            return
        running = _cluster_ports(n for n in self.nodes if n.running)
        if running:
            node.routes = running
            node.start()
            return
        for attempt in range(1, PORT_ATTEMPTS + 1):
            node.cluster_port = free_port()  # picked ahead: the route to itself names it
            node.routes = [node.cluster_port]
            try:
                node.start()
                return
            except PortInUseError:
                node.cluster_port = None
                if attempt == PORT_ATTEMPTS:
                    raise

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


def _cluster_ports(nodes: Iterable[ClusterNode]) -> list[int]:
    """The cluster ports of ``nodes``; every node started has one (picked before it starts)."""
    return [n.cluster_port for n in nodes if n.cluster_port is not None]
