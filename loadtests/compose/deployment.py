"""The compose deployment under test: podman-compose with compose.yaml and the stand-ins
override, on host ports chosen free, and what the scenario asks of it (containers, health,
secrets in volumes, a kill)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from loadtests.compose.podman import COMPOSE_DIR, Podman, log

#: Services that run once and exit: done when they exited 0.
ONE_SHOTS = ("nats-users", "provision")
#: Host ports compose.yaml publishes (its variables), moved to free ports so that nothing else
#: on the host (a developer's own NATS on 4222, PostgreSQL on 5432) is in the way.
PORT_VARIABLES = ("NATS_PORT", "NATS_MONITOR_PORT", "POSTGRES_PORT", "OTLP_HTTP_PORT", "INFERENCE_PORTS")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class HealthTimeout(RuntimeError):
    pass


@dataclass
class Deployment:
    podman: Podman
    podman_compose: str
    project: str = "artery-composetest"
    ports: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.ports = self.ports or {name: free_port() for name in PORT_VARIABLES}
        self.env = {
            **self.podman.env,
            **{name: str(port) for name, port in self.ports.items()},
            "COMPOSE_PROFILES": "cpu",
            "PROJECT": "demo",
            "MODEL": "agent",
            "BASE_MODEL": "artery/tiny-random",
            # Each service uses one core at most: the machine is small and shared.
            "TORCH_THREADS": "1",
        }

    def _files(self) -> list[str]:
        return ["-f", str(COMPOSE_DIR / "compose.yaml"), "-f", str(COMPOSE_DIR / "compose.standins.yaml")]

    # --- podman-compose ---------------------------------------------------------------------

    def compose(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        command = [self.podman_compose, "--project-name", self.project, *self._files(), *args]
        output = self.podman.work / "compose.log"
        with output.open("a") as handle:
            handle.write(f"\n$ {' '.join(command)}\n")
            handle.flush()
            result = subprocess.run(
                command, cwd=COMPOSE_DIR, env=self.env, stdout=handle, stderr=subprocess.STDOUT, check=False
            )
        if check and result.returncode:
            raise RuntimeError(f"podman-compose {' '.join(args)} failed ({result.returncode}); see {output}")
        return result

    def config(self) -> dict:
        """The merged configuration (profiles applied) as podman-compose reads it."""
        command = [self.podman_compose, "--project-name", self.project, *self._files(), "config"]
        result = subprocess.run(
            command, cwd=COMPOSE_DIR, env=self.env, capture_output=True, text=True, check=True
        )
        return yaml.safe_load(result.stdout)

    def up(self) -> None:
        """``up -d``, one dependency level at a time, each level once the conditions of its
        ``depends_on`` hold. podman-compose leaves that to podman (``--requires``), and podman
        4.3 cannot start a container whose requirements include a one-shot that has exited
        (``generating dependency graph ... not found in input list``), nor tell a healthy
        container (``podman wait --condition=healthy`` came in 4.6). Docker Compose does this
        ordering itself; here the harness does it."""
        services = self.config()["services"]
        depends = {name: dict(service.get("depends_on") or {}) for name, service in services.items()}
        level: dict[str, int] = {}

        def depth(name: str) -> int:
            if name not in level:
                level[name] = 1 + max((depth(d) for d in depends[name]), default=-1)
            return level[name]

        for name in services:
            depth(name)
        for current in range(max(level.values()) + 1):
            batch = sorted(name for name, n in level.items() if n == current)
            conditions = {
                d: c.get("condition", "service_started") for n in batch for d, c in depends[n].items()
            }
            self.wait_for(conditions)
            self.compose("up", "-d", "--no-build", "--no-deps", *batch)

    def wait_for(self, conditions: dict[str, str], timeout_s: float = 600.0) -> None:
        """Until each service meets its ``depends_on`` condition."""
        deadline = time.monotonic() + timeout_s
        pending = dict(conditions)
        while pending:
            containers = self.containers()
            for service, condition in list(pending.items()):
                info = containers.get(service)
                if info is None:
                    continue
                state = info["State"]
                if condition == "service_completed_successfully":
                    met = state["Status"] == "exited" and state["ExitCode"] == 0
                elif condition == "service_healthy":
                    met = state["Status"] == "running" and self._healthy(info)
                else:
                    met = state["Status"] == "running"
                if met:
                    del pending[service]
            if pending and time.monotonic() > deadline:
                raise HealthTimeout(f"depends_on not met after {timeout_s:.0f} s: {pending}")
            if pending:
                time.sleep(1.0)  # between rounds of checks, as a healthcheck interval

    def down(self, volumes: bool = False) -> None:
        self.compose("down", *(["--volumes"] if volumes else []), check=False)

    # --- containers -----------------------------------------------------------------------------

    def containers(self) -> dict[str, dict]:
        """service -> ``podman inspect`` of its (first) container."""
        names = self.podman.output(
            "ps",
            "-a",
            "--filter",
            f"label=io.podman.compose.project={self.project}",
            "--format",
            "{{.Names}}",
        ).split()
        if not names:
            return {}
        found = {}
        for info in json.loads(self.podman.output("inspect", *names)):
            service = info["Config"]["Labels"].get("com.docker.compose.service")
            found.setdefault(service, info)
        return found

    def container(self, service: str) -> dict:
        return self.containers()[service]

    def wait_healthy(self, timeout_s: float = 900.0) -> dict[str, float]:
        """Until every one-shot exited 0 and every service's health check passes; the seconds
        each took from now. Podman runs health checks from systemd timers, which a host without
        systemd does not have: their commands are run here (``podman healthcheck run``), which
        is also what sets the container's health status."""
        started = time.monotonic()
        done: dict[str, float] = {}
        last_report = 0.0
        while True:
            containers = self.containers()
            for service, info in containers.items():
                if service not in done and self._done(service, info):
                    done[service] = time.monotonic() - started
                    what = "done" if service in ONE_SHOTS else "healthy"
                    log(f"  {service}: {what} after {done[service]:.0f} s")
            if containers and set(containers) <= set(done):
                return done
            elapsed = time.monotonic() - started
            if elapsed > timeout_s:
                waiting = sorted(set(containers) - set(done))
                raise HealthTimeout(f"not healthy after {timeout_s:.0f} s: {waiting}; see `podman logs`")
            if elapsed - last_report > 60:
                last_report = elapsed
                log(f"  waiting for {sorted(set(containers) - set(done))}")
            time.sleep(1.0)  # between rounds of health checks, as a healthcheck interval

    def _done(self, service: str, info: dict) -> bool:
        state = info["State"]
        if service in ONE_SHOTS:
            return state["Status"] == "exited" and state["ExitCode"] == 0
        if state["Status"] != "running":
            return False
        return self._healthy(info)

    def _healthy(self, info: dict) -> bool:
        """Runs the container's health check (which also records its health status); a
        container without one is healthy while it runs."""
        if not info["Config"].get("Healthcheck"):
            return True
        return self.podman.run("healthcheck", "run", info["Id"], check=False, capture=True).returncode == 0

    def logs(self, service: str, tail: int = 40) -> str:
        info = self.container(service)
        result = self.podman.run("logs", "--tail", str(tail), info["Id"], check=False, capture=True)
        return result.stdout + result.stderr

    def kill(self, service: str) -> tuple[int, int]:
        """SIGKILL the container's main process from the host, as the kernel's OOM killer would
        (``podman kill`` would count as stopping it by hand). Returns (pid, restart count)."""
        info = self.container(service)
        pid = info["State"]["Pid"]
        os.kill(pid, signal.SIGKILL)
        return pid, info.get("RestartCount", 0)

    # --- volumes ------------------------------------------------------------------------------

    def volume(self, name: str) -> str:
        return f"{self.project}_{name}"

    def read_volume_file(self, volume: str, name: str) -> str:
        mountpoint = Path(
            self.podman.output("volume", "inspect", "--format", "{{.Mountpoint}}", self.volume(volume))
        )
        if os.geteuid() == 0:
            return (mountpoint / name).read_text().strip()
        return self.podman.output("unshare", "cat", str(mountpoint / name))  # rootless podman

    def nats_password(self, user: str) -> str:
        """A NATS user's password, from the volume only that user's service mounts."""
        volume = "nats-secret-agent" if user.startswith("agent-") else f"nats-secret-{user}"
        return self.read_volume_file(volume, "password")

    def volumes(self) -> list[str]:
        return self.podman.output(
            "volume",
            "ls",
            "--filter",
            f"label=io.podman.compose.project={self.project}",
            "--format",
            "{{.Name}}",
        ).split()

    # --- URLs on the host ---------------------------------------------------------------------

    @property
    def nats_url(self) -> str:
        return f"nats://127.0.0.1:{self.ports['NATS_PORT']}"

    @property
    def inference_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['INFERENCE_PORTS']}/v1"

    @property
    def spans_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['OTLP_HTTP_PORT']}/spans"

    @property
    def database_url(self) -> str:
        return f"postgresql://artery:artery@127.0.0.1:{self.ports['POSTGRES_PORT']}/artery"
