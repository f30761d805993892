"""The embedded servers start without port races and clean up after themselves (``shared.embedded``,
``shared.cluster``): nats-server binds ports of its own choosing, PostgreSQL moves off a port taken
before it could bind it, a failed start says why in the server's own words and leaves nothing
running, and a restarted cluster node comes back where its clients look."""

from __future__ import annotations

import signal
import socket
import subprocess

import pytest

from artery.ops.stack import Stack
from artery.shared import embedded
from artery.shared.embedded import NatsServer, PortInUseError, PostgresServer
from artery.testing.cluster import ClusterNode, NatsCluster


@pytest.fixture
def taken_port():
    """A port something else listens on for the whole test."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield held.getsockname()[1]


def nats_info(port: int) -> bytes:
    """The first line a NATS server sends to a client."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        return conn.makefile("rb").readline()


def gone(proc: subprocess.Popen) -> bool:
    return proc.poll() is not None


def record_starts(monkeypatch, server_class) -> list[subprocess.Popen]:
    """The process of every server of ``server_class`` that starts from now on (a list that
    fills up): a failed start's clean-up forgets them."""
    started = []
    start = server_class.start

    def recording_start(server):
        start(server)
        started.append(server.proc)
        return server

    monkeypatch.setattr(server_class, "start", recording_start)
    return started


def test_servers_without_a_port_bind_distinct_ones_and_keep_them_across_a_restart(tmp_path):
    first = NatsServer(tmp_path / "a").start()
    second = NatsServer(tmp_path / "b").start()
    try:
        assert first.port != second.port
        assert nats_info(first.port).startswith(b"INFO ") and nats_info(second.port).startswith(b"INFO ")
        port = first.port
        first.stop(signal.SIGKILL)
        assert not list((tmp_path / "a").glob("*.ports")), "a killed server's ports file is cleaned up"
        first.start()
        assert first.port == port and nats_info(port).startswith(b"INFO ")
    finally:
        first.stop()
        second.stop()


def test_a_given_port_that_is_taken_fails_with_the_servers_own_words(tmp_path, taken_port):
    server = NatsServer(tmp_path / "nats", taken_port)
    with pytest.raises(PortInUseError, match="address already in use"):
        server.start()
    assert server.proc is None and server.port == taken_port


def test_a_cluster_node_that_fails_to_start_stops_the_nodes_started_before_it(tmp_path, monkeypatch):
    started = record_starts(monkeypatch, ClusterNode)
    cluster = NatsCluster(tmp_path / "cluster", size=3)
    cluster.node("n2").extra_config = "no_such_option: 1"
    with pytest.raises(RuntimeError, match='unknown field "no_such_option"'):
        cluster.start()
    assert len(started) == 1, "n1 was running when n2 failed"
    assert all(gone(proc) for proc in started)
    assert not any(node.running for node in cluster.nodes)


def test_a_killed_cluster_node_restarts_on_its_ports(tmp_path):
    with NatsCluster(tmp_path / "cluster", size=3) as cluster:
        victim = cluster.node("n2")
        ports = (victim.port, victim.cluster_port, victim.http_port)
        assert len({n.port for n in cluster.nodes}) == 3
        cluster.kill("n2")
        cluster.restart("n2")
        assert (victim.port, victim.cluster_port, victim.http_port) == ports
        assert nats_info(victim.port).startswith(b"INFO ")
        cluster.wait_ready()


def test_postgres_moves_off_a_port_taken_before_it_could_bind_it(tmp_path, monkeypatch, taken_port):
    picks = iter([taken_port])
    free_port = embedded.free_port
    monkeypatch.setattr(embedded, "free_port", lambda: next(picks, None) or free_port())
    server = PostgresServer(tmp_path / "data", durable=False)
    assert server.port == taken_port
    try:
        server.start()
        assert server.port != taken_port
        assert "Address already in use" in server.log_file.read_text(), "the first try was on the taken port"
        port = server.port
        server.stop()
        server.start()
        assert server.port == port, "once up, a server keeps its port"
    finally:
        server.stop()


def test_postgres_on_a_given_port_that_is_taken_fails_with_its_own_log_lines(tmp_path, taken_port):
    server = PostgresServer(tmp_path / "data", taken_port, durable=False)
    with pytest.raises(PortInUseError) as failure:
        server.start()
    assert "could not bind" in str(failure.value) and f"port {taken_port}" in str(failure.value)
    assert server.proc is None


def test_a_stack_whose_postgres_fails_stops_its_nats(tmp_path, monkeypatch):
    def broken_start(server: PostgresServer) -> PostgresServer:
        raise RuntimeError("postgres exited with code 1")

    monkeypatch.setattr(PostgresServer, "start", broken_start)
    started = record_starts(monkeypatch, NatsServer)
    stack = Stack(home=tmp_path / "stack", services=())
    with pytest.raises(RuntimeError, match="postgres exited"):
        stack.start()
    assert len(started) == 1 and gone(started[0])
    assert (stack.nats, stack.nats_url) == (None, None), "a later start starts NATS again"


def test_a_stack_whose_service_never_gets_ready_stops_everything(tmp_path, monkeypatch):
    nats, postgres = record_starts(monkeypatch, NatsServer), record_starts(monkeypatch, PostgresServer)
    stack = Stack(
        home=tmp_path / "stack", services=("collector",), extra_env={"ARTERY_COLLECTOR_BATCH_SIZE": "lots"}
    )
    with pytest.raises(RuntimeError, match="collector exited"):
        stack.start()
    assert not stack.processes["collector"].running
    assert len(nats) == len(postgres) == 1 and gone(nats[0]) and gone(postgres[0])
