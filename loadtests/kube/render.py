"""The manifests of kubernetes/ as ``podman kube play`` (4.3) can run them: one Pod at a time,
each with the names Kubernetes' DNS would give it. The manifests themselves stay what a cluster
applies; this is the only place that knows podman.

What podman 4.3's kube play lacks, and what is done instead (docs/operations/kubernetes.md):

- StatefulSet, Job and Service are not kinds it plays (Pod, Deployment, PersistentVolumeClaim
  and ConfigMap are): each StatefulSet replica becomes a Pod ``<name>-<i>`` with its
  volumeClaimTemplates as named volumes, a Job's template a Pod (its restartPolicy retries it),
  each Deployment replica a Pod ``<name>-<i>``; a Service becomes DNS aliases on the podman
  network of the pods its selector matches (``nats``, ``postgres``, ``inference``), and a
  StatefulSet pod also gets ``<pod>.<serviceName>``, the name its peers route to.
- Secret volumes are written base64-encoded by 4.3 (and ``optional`` unset crashes it): each
  becomes a hostPath directory of files the harness writes, readable by the pod's user only.
- ``secretKeyRef`` reads a podman secret holding ``{key: base64}`` JSON: one is created per
  Secret; an optional reference to a Secret that was not generated is left out, as Kubernetes
  leaves the variable unset.
- Images: the local builds (``loadtests/kube/images.py``), nats and postgres as compose's
  stand-ins.
- A container's ports are published on the host by 4.3 (as if each had a hostPort), where
  they collide with whatever listens there: they are left out, and probes name port numbers.
- Probes are not run by podman here (no systemd timers): the harness runs each readiness
  probe itself, as the kubelet would (``deployment.py``).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from loadtests.kube.images import local_image

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS_DIR = ROOT / "kubernetes"
#: Pod, volume, secret and network names here start with this: nothing of a concurrent
#: `make compose-test` (project ``artery-composetest``) or another user of podman is touched.
PREFIX = "artery-kube"


def load_manifests(directory: Path = MANIFESTS_DIR) -> list[dict]:
    """Every document of ``directory/*.yaml`` (not its subfolders: gpu/ replaces two of them)."""
    documents = []
    for path in sorted(directory.glob("*.yaml")):
        documents += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return documents


@dataclass
class PodPlan:
    """One pod to play: the Pod (with the ConfigMaps it reads) and its DNS names."""

    name: str  # the Kubernetes name: nats-0, collector-0, provision
    workload: str  # the StatefulSet, Deployment or Job it comes from
    kind: str
    pod: dict
    config_maps: list[dict]
    aliases: list[str] = field(default_factory=list)
    #: hostPath directory -> Secret it stands for (written by the harness before playing)
    secret_dirs: dict[str, str] = field(default_factory=dict)

    @property
    def podman_name(self) -> str:
        return f"{PREFIX}-{self.name}"

    def document(self) -> str:
        return yaml.safe_dump_all([*self.config_maps, self.pod], sort_keys=False)

    def containers(self) -> list[dict]:
        return self.pod["spec"]["containers"]


def _matches(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def _pods_of(workload: dict) -> Iterable[tuple[str, dict]]:
    kind, name = workload["kind"], workload["metadata"]["name"]
    template = workload["spec"]["template"]
    if kind == "Job":
        yield name, template
        return
    for index in range(workload["spec"].get("replicas", 1)):
        yield f"{name}-{index}", template


def plan(
    documents: list[dict],
    secrets_dir: Path,
    generated_secrets: set[str],
    env_overrides: dict[str, str] | None = None,
) -> list[PodPlan]:
    """The pods of every StatefulSet, Deployment and Job, in the order of ``documents``."""
    config_maps = {d["metadata"]["name"]: d for d in documents if d["kind"] == "ConfigMap"}
    services = [d for d in documents if d["kind"] == "Service"]
    plans = []
    for workload in documents:
        if workload["kind"] not in ("StatefulSet", "Deployment", "Job"):
            continue
        for pod_name, template in _pods_of(workload):
            plans.append(
                _pod(
                    workload,
                    pod_name,
                    copy.deepcopy(template),
                    config_maps,
                    services,
                    secrets_dir,
                    generated_secrets,
                    env_overrides or {},
                )
            )
    return plans


def _pod(
    workload: dict,
    name: str,
    template: dict,
    config_maps: dict[str, dict],
    services: list[dict],
    secrets_dir: Path,
    generated_secrets: set[str],
    env_overrides: dict[str, str],
) -> PodPlan:
    kind = workload["kind"]
    labels = template.get("metadata", {}).get("labels", {})
    spec = template["spec"]
    spec["hostname"] = name
    if kind == "Job":
        spec.setdefault("restartPolicy", "OnFailure")
    else:
        spec["restartPolicy"] = "Always"
    plan = PodPlan(
        name=name,
        workload=workload["metadata"]["name"],
        kind=kind,
        pod={
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": f"{PREFIX}-{name}", "labels": labels},
            "spec": spec,
        },
        config_maps=[],
    )
    for service in services:
        if _matches(service["spec"].get("selector", {}), labels):
            plan.aliases.append(service["metadata"]["name"])
    if kind == "StatefulSet":
        plan.aliases.append(f"{name}.{workload['spec']['serviceName']}")
        for claim in workload["spec"].get("volumeClaimTemplates", []):
            claim_name = claim["metadata"]["name"]
            spec.setdefault("volumes", []).append(
                {"name": claim_name, "persistentVolumeClaim": {"claimName": f"{PREFIX}-{claim_name}-{name}"}}
            )
    used_maps: set[str] = set()
    for volume in spec.get("volumes", []):
        if "configMap" in volume:
            used_maps.add(volume["configMap"]["name"])
        if "secret" in volume:
            secret = volume.pop("secret")["secretName"]
            path = secrets_dir / secret
            volume["hostPath"] = {"path": str(path), "type": "Directory"}
            plan.secret_dirs[str(path)] = secret
    for container in spec["containers"]:
        container["image"] = local_image(container["image"])
        ports = {p["name"]: p["containerPort"] for p in container.pop("ports", []) if "name" in p}
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            get = container.get(kind, {}).get("httpGet")
            if get is not None and isinstance(get["port"], str):
                get["port"] = ports[get["port"]]
        for source in container.get("envFrom", []):
            if "configMapRef" in source:
                used_maps.add(source["configMapRef"]["name"])
        env = []
        for variable in container.get("env", []):
            ref = variable.get("valueFrom", {}).get("secretKeyRef")
            if ref is not None:
                if ref["name"] not in generated_secrets:
                    if ref.get("optional"):
                        continue  # as Kubernetes: the variable is not set
                    raise ValueError(f"{name}: Secret {ref['name']} is not generated")
                ref["name"] = f"{PREFIX}-{ref['name']}"
            if variable["name"] in env_overrides:
                variable = {"name": variable["name"], "value": env_overrides[variable["name"]]}
            env.append(variable)
        container["env"] = env
    plan.config_maps = [config_maps[n] for n in sorted(used_maps)]
    return plan
