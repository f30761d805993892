"""One service as a child process of the stack: its start (under the interpreter the stack picks:
an inference replica on the vLLM engine has a virtualenv of its own), its ``ready`` line, signals
and stop. It lives no longer than the process that started it: ``ARTERY_LIFELINE_PID`` names that
process, and the service watches it (``shared.lifeline``)."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from artery.shared.embedded import stop_process
from artery.shared.lifeline import child_env

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
    #: The interpreter it runs under (the vLLM engine's replicas have a virtualenv of their own).
    python: str = sys.executable
    proc: subprocess.Popen | None = None
    restarts: int = 0
    #: The fields of its last ``ready`` line (``url`` of the console and of a replica...).
    ready_info: dict = field(default_factory=dict)
    _log_offset: int = 0

    def start(self) -> None:
        self._log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [self.python, "-m", f"artery.services.{self.service or self.name}"],
                env={**self.env, **child_env()},  # whoever starts it now: a restart may be elsewhere
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
                    f"{self.name} exited with code {self.popen().returncode}; see {self.log_path}"
                )
            with open(self.log_path, "rb") as f:
                f.seek(self._log_offset)
                for line in f.read().splitlines(keepends=True):
                    if READY_MARKER in line and line.endswith(b"\n"):  # whole: its fields are read
                        with contextlib.suppress(ValueError):
                            self.ready_info = json.loads(line)
                        return
            time.sleep(0.05)
        raise TimeoutError(f"{self.name} not ready within {timeout}s; see {self.log_path}")

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def popen(self) -> subprocess.Popen:
        """The process ``start`` made (its pid, its exit code); an error before ``start``."""
        if self.proc is None:
            raise RuntimeError(f"{self.name} was never started")
        return self.proc

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self, timeout: float = 15.0) -> int | None:
        return stop_process(self.proc, signal.SIGTERM, timeout)
