"""The embedded stack: NATS, PostgreSQL and every service as child processes of one parent.

Used by ``artery up``, by the SDK's ``LocalBackend``, by the test suite and by the benchmarks, so
all of them run the same processes the same way. State lives under one home directory:
``nats/`` (JetStream store), ``postgres/`` (the cluster), ``logs/`` (one file per process) and
``stack.json`` (where to connect, for ``artery status`` and other clients).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from artery.shared.embedded import NatsServer, PostgresServer, postgres_bin_dir, stop_process

#: Every model-independent service, in start order. Inference replicas serve one model each and
#: are started per model (``LocalBackend.register``, ``artery up --serve``).
SERVICES: tuple[str, ...] = ("collector", "publisher", "trainer")
DATABASE = "artery"
#: Every service logs this event once it is set up and serving (see ``shared.runtime``).
READY_MARKER = b'"event": "ready"'


@dataclass
class ServiceProcess:
    #: Instance name (``collector``, ``inference-demo-agent``); unique within a stack.
    name: str
    env: dict[str, str]
    log_path: Path
    #: The service package under ``artery.services`` (defaults to the instance name).
    service: str = ""
    proc: subprocess.Popen | None = None
    restarts: int = 0
    _log_offset: int = 0

    def start(self) -> None:
        self._log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", f"artery.services.{self.service or self.name}"],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C reaches the parent, which stops children in order
            )

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Block until the service logs its ``ready`` line (set-up done, consuming)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.running:
                raise RuntimeError(
                    f"{self.name} exited with code {self.proc.returncode}; see {self.log_path}"
                )
            with open(self.log_path, "rb") as f:
                f.seek(self._log_offset)
                if READY_MARKER in f.read():
                    return
            time.sleep(0.05)
        raise TimeoutError(f"{self.name} not ready within {timeout}s; see {self.log_path}")

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.running:
            self.proc.send_signal(sig)

    def stop(self, timeout: float = 15.0) -> int | None:
        return stop_process(self.proc, signal.SIGTERM, timeout)


@dataclass
class Stack:
    home: Path
    nats_url: str | None = None
    database_url: str | None = None
    services: tuple[str, ...] = SERVICES
    extra_env: dict[str, str] = field(default_factory=dict)
    durable: bool = True
    nats: NatsServer | None = None
    postgres: PostgresServer | None = None
    processes: dict[str, ServiceProcess] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.home = Path(self.home).resolve()

    @property
    def logs(self) -> Path:
        return self.home / "logs"

    def start_infrastructure(self) -> None:
        """NATS and PostgreSQL, unless URLs of running ones were given."""
        self.home.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(exist_ok=True)
        if self.nats_url is None:
            self.nats = NatsServer(self.home / "nats", log_file=self.logs / "nats-server.log").start()
            self.nats_url = self.nats.url
        if self.database_url is None:
            self.postgres = PostgresServer(
                self.home / "postgres", log_file=self.logs / "postgres.log", durable=self.durable
            ).start()
            _create_database(self.postgres, DATABASE)
            self.database_url = self.postgres.dsn(DATABASE)
        (self.home / "stack.json").write_text(
            json.dumps({"nats_url": self.nats_url, "database_url": self.database_url, "pid": os.getpid()})
        )

    def service_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            {
                "ARTERY_NATS_URL": self.nats_url or "",
                "ARTERY_DATABASE_URL": self.database_url or "",
                "PYTHONUNBUFFERED": "1",
                "ARTERY_LOG_FORMAT": "json",  # the readiness check reads these lines
                # Trainer and publisher share this directory (the publisher reads the adapters).
                "ARTERY_TRAINER_CHECKPOINT_DIR": str(self.home / "checkpoints"),
            }
        )
        env.update(self.extra_env)
        return env

    def start_services(self, wait: bool = True) -> None:
        for name in self.services:
            self.start_service(name)
        if wait:
            for name in self.services:
                self.processes[name].wait_ready()

    def start_service(
        self, name: str, *, service: str | None = None, env: dict[str, str] | None = None
    ) -> ServiceProcess:
        """Start (or restart) instance ``name`` of ``service`` with extra environment ``env``."""
        process = self.processes.get(name) or ServiceProcess(
            name, {**self.service_env(), **(env or {})}, self.logs / f"{name}.log", service=service or name
        )
        process.start()
        self.processes[name] = process
        return process

    def kill_service(self, name: str) -> None:
        """SIGKILL, as a crash would: no clean-up runs."""
        process = self.processes[name]
        process.signal(signal.SIGKILL)
        process.proc.wait()

    def restart_service(self, name: str) -> None:
        process = self.processes[name]
        process.stop()
        process.restarts += 1
        process.start()

    def start(self) -> Stack:
        self.start_infrastructure()
        self.start_services()
        return self

    def stop(self) -> None:
        """Services first (they drain), then the servers they need."""
        for process in reversed(list(self.processes.values())):
            process.stop()
        if self.postgres is not None:
            self.postgres.stop()
        if self.nats is not None:
            self.nats.stop()

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _create_database(server: PostgresServer, name: str) -> None:
    exists = subprocess.run(
        [
            str(postgres_bin_dir() / "psql"),
            server.dsn(),
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
                str(server.port),
                "-U",
                "postgres",
                name,
            ],
            check=True,
            capture_output=True,
        )


def wait_until(predicate, timeout: float, interval: float = 0.05, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise TimeoutError(f"{what} not met within {timeout}s")
