"""The manifests played with podman: a network of their own, the Secrets, the pods in the
order a cluster would settle them (StatefulSets, then the Job, then the Deployments), each
pod's readiness probe run as the kubelet would, and everything removed afterwards."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from loadtests.compose.podman import Podman
from loadtests.kube import render, secrets

NETWORK = f"{render.PREFIX}-net"
ORDER = ("StatefulSet", "Job", "Deployment")
KUBE_DEFAULT_NETWORK = "podman-default-kube-network"


def log(message: str) -> None:
    print(f"[kube-test {time.strftime('%H:%M:%S')}] {message}", flush=True)


class NotReady(RuntimeError):
    pass


@dataclass
class KubeDeployment:
    podman: Podman
    project: str = "demo"
    env_overrides: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.work = Path(tempfile.mkdtemp(dir=self.podman.work, prefix="run-"))
        os.chmod(self.work, 0o711)  # the pods' user reaches its own secret directory only
        self.secret_values: dict[str, dict[str, str]] = {}
        self.plans: list[render.PodPlan] = []
        self.ips: dict[str, str] = {}

    # --- up ------------------------------------------------------------------------------------

    def prepare(self) -> None:
        """Secrets generated, written and created in podman; the pods planned; the network."""
        self.secret_values = secrets.generate(self.work / "generated", self.project)
        secrets.write_files(self.secret_values, self.work / "secrets")
        for name, data in self.secret_values.items():
            source = self.work / f"{name}.json"
            source.write_bytes(secrets.env_secret(data))
            os.chmod(source, 0o600)
            self.podman.run("secret", "create", f"{render.PREFIX}-{name}", str(source), capture=True)
            source.unlink()
        self.plans = render.plan(
            render.load_manifests(), self.work / "secrets", set(self.secret_values), self.env_overrides
        )
        self.plans.sort(key=lambda p: ORDER.index(p.kind))
        self.podman.run("network", "create", NETWORK, capture=True)

    def play(self, plan: render.PodPlan) -> None:
        path = self.work / f"{plan.name}.yaml"
        path.write_text(plan.document())
        network = ",".join([NETWORK, *(f"alias={a}" for a in plan.aliases)]).replace(",", ":", 1)
        result = self.podman.run("kube", "play", "--network", network, str(path), check=False, capture=True)
        if result.returncode:
            raise RuntimeError(f"podman kube play {plan.name} failed: {result.stderr.strip()[-2000:]}")

    def up(self, timings: dict[str, float]) -> None:
        """Each stage played, then waited for: StatefulSets ready, the Job done, Deployments ready."""
        started = time.monotonic()
        for kind in ORDER:
            stage = [p for p in self.plans if p.kind == kind]
            for plan in stage:
                self.play(plan)
            log(f"played {', '.join(p.name for p in stage)}")
            if kind == "Job":
                for plan in stage:
                    self.wait_completed(plan)
                    timings[plan.name] = round(time.monotonic() - started, 1)
                    log(f"  {plan.name}: completed after {timings[plan.name]:.0f} s")
            else:
                for name, seconds in self.wait_ready(stage, started).items():
                    timings[name] = round(seconds, 1)

    # --- pods ------------------------------------------------------------------------------------

    def plan(self, name: str) -> render.PodPlan:
        return next(p for p in self.plans if p.name == name)

    def container(self, plan: render.PodPlan, index: int = 0) -> dict:
        name = f"{plan.podman_name}-{plan.containers()[index]['name']}"
        return json.loads(self.podman.output("container", "inspect", name))[0]

    def ip(self, name: str) -> str:
        """The pod's address on the network (its infra container's: it outlives restarts)."""
        if name not in self.ips:
            pod = json.loads(self.podman.output("pod", "inspect", self.plan(name).podman_name))
            info = json.loads(self.podman.output("container", "inspect", pod["InfraContainerID"]))[0]
            self.ips[name] = info["NetworkSettings"]["Networks"][NETWORK]["IPAddress"]
        return self.ips[name]

    def probe(self, plan: render.PodPlan, container: dict, probe: dict) -> bool:
        """One run of a probe, as the kubelet runs it: an HTTP GET of the pod's IP (2xx or 3xx
        is success) or a command in the container (exit 0)."""
        if "httpGet" in probe:
            get = probe["httpGet"]
            url = f"http://{self.ip(plan.name)}:{get['port']}{get.get('path', '/')}"
            try:
                with urllib.request.urlopen(url, timeout=probe.get("timeoutSeconds", 1)) as response:
                    return 200 <= response.status < 400
            except (urllib.error.URLError, OSError):
                return False
        if "exec" in probe:
            name = f"{plan.podman_name}-{container['name']}"
            result = self.podman.run("exec", name, *probe["exec"]["command"], check=False, capture=True)
            return result.returncode == 0
        raise ValueError(f"{plan.name}: probe {probe} is neither httpGet nor exec")

    def ready(self, plan: render.PodPlan) -> bool:
        for index, container in enumerate(plan.containers()):
            if self.container(plan, index)["State"]["Status"] != "running":
                return False
            probe = container.get("readinessProbe")
            if probe is not None and not self.probe(plan, container, probe):
                return False
        return True

    def wait_ready(self, plans: list[render.PodPlan], started: float, timeout_s: float = 900.0) -> dict:
        done: dict[str, float] = {}
        last_report = time.monotonic()
        while len(done) < len(plans):
            for plan in plans:
                if plan.name not in done and self.ready(plan):
                    done[plan.name] = time.monotonic() - started
                    log(f"  {plan.name}: ready after {done[plan.name]:.0f} s")
            waiting = [p.name for p in plans if p.name not in done]
            if waiting and time.monotonic() - started > timeout_s:
                raise NotReady(f"not ready after {timeout_s:.0f} s: {waiting}")
            if waiting and time.monotonic() - last_report > 60:
                last_report = time.monotonic()
                log(f"  waiting for {waiting}")
            if waiting:
                time.sleep(1.0)  # between rounds of probes, as a probe's period
        return done

    def wait_completed(self, plan: render.PodPlan, timeout_s: float = 600.0) -> None:
        """Until the Job's container exited 0 (restartPolicy OnFailure retries it meanwhile)."""
        deadline = time.monotonic() + timeout_s
        while True:
            state = self.container(plan)["State"]
            if state["Status"] == "exited" and state["ExitCode"] == 0:
                return
            if time.monotonic() > deadline:
                raise NotReady(f"{plan.name} not completed after {timeout_s:.0f} s: {state['Status']}")
            time.sleep(1.0)  # between looks at the container's state

    def wait_restarted(self, name: str, restarts: int, timeout_s: float = 300.0) -> dict:
        """Until the pod's container runs again after ``restarts`` restarts and is ready; its
        ``podman inspect``."""
        deadline = time.monotonic() + timeout_s
        plan = self.plan(name)
        while True:
            info = self.container(plan)
            if info.get("RestartCount", 0) > restarts and self.ready(plan):
                return info
            if time.monotonic() > deadline:
                raise NotReady(f"{name} not back after {timeout_s:.0f} s: {info['State']['Status']}")
            time.sleep(1.0)  # between looks, as a probe's period

    def logs(self, name: str, tail: int = 30) -> str:
        plan = self.plan(name)
        container = f"{plan.podman_name}-{plan.containers()[0]['name']}"
        result = self.podman.run("logs", "--tail", str(tail), container, check=False, capture=True)
        return result.stdout + result.stderr

    # --- secrets and URLs seen from the host ---------------------------------------------------------

    def nats_password(self, user: str) -> str:
        return self.secret_values[f"artery-nats-{user}"]["password"]

    @property
    def nats_url(self) -> str:
        return f"nats://{self.ip('nats-0')}:4222"

    @property
    def inference_url(self) -> str:
        return f"http://{self.ip('inference-0')}:8000/v1"

    @property
    def database_url(self) -> str:
        password = self.secret_values["artery-postgres"]["password"]
        return f"postgresql://artery:{password}@{self.ip('postgres-0')}:5432/artery"

    # --- down ------------------------------------------------------------------------------------

    def teardown(self) -> list[str]:
        """Pods, their volumes, the secrets, the network and the files; what is left over."""
        for pod in self.pods():
            self.podman.run("pod", "rm", "--force", "--time", "5", pod, check=False, capture=True)
        for volume in self.volumes():
            self.podman.run("volume", "rm", "--force", volume, check=False, capture=True)
        for secret in self.secrets():
            self.podman.run("secret", "rm", secret, check=False, capture=True)
        self.podman.run("network", "rm", "--force", NETWORK, check=False, capture=True)
        # kube play creates this one on first use even with --network; removed unless in use.
        self.podman.run("network", "rm", KUBE_DEFAULT_NETWORK, check=False, capture=True)
        shutil.rmtree(self.work, ignore_errors=True)
        return self.pods() + self.volumes() + self.secrets() + self.networks()

    def _names(self, *args: str) -> list[str]:
        output = self.podman.run(*args, check=False, capture=True).stdout.split()
        return [name for name in output if name.startswith(render.PREFIX)]

    def pods(self) -> list[str]:
        return self._names("pod", "ps", "--format", "{{.Name}}")

    def volumes(self) -> list[str]:
        return self._names("volume", "ls", "--format", "{{.Name}}")

    def secrets(self) -> list[str]:
        return self._names("secret", "ls", "--format", "{{.Name}}")

    def networks(self) -> list[str]:
        return self._names("network", "ls", "--format", "{{.Name}}")
