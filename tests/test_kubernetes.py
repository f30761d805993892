"""The Kubernetes manifests (kubernetes/), checked without a cluster.

Every document is validated, offline, against the Kubernetes OpenAPI schemas that the
``kubernetes-validate`` package bundles (strict: an unknown or misspelt field fails), for the
oldest and the newest Kubernetes this deployment is meant for. Then against the project: every
workload's containers have liveness and readiness probes (an Artery service's on /healthz and
/readyz of its metrics port), resource requests and a memory limit; no credential is a literal
value (they come from Secrets, which the directory does not hold); the images are the ones
compose builds for the same service; every variable compose sets for a service is set here too,
and every ARTERY_* one is a setting the service accepts. Running them is `make kube-test`
(loadtests/kube/, podman kube play), not part of this suite.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from artery.shared.settings import CommonSettings, load
from loadtests.kube import render
from tests.test_compose import (
    COMMON_NAMES,
    SERVICE_NAMES,
    SERVICES,
    SETTINGS,
    environment,
    metrics_variables,
)

ROOT = Path(__file__).resolve().parent.parent
MANIFESTS = ROOT / "kubernetes"
#: The oldest Kubernetes still supported upstream when this was written, and the newest bundled.
VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
WORKLOADS = ("Deployment", "StatefulSet", "Job")
ARTERY_IMAGES = ("artery-slim", "artery-cpu", "artery-gpu")
#: kubernetes/ file -> the compose service it deploys (its image and environment are compared).
COMPOSE_SERVICE = {
    "nats.yaml": "nats",
    "postgres.yaml": "postgres",
    "provision.yaml": "provision",
    "collector.yaml": "collector",
    "reward.yaml": "reward",
    "publisher.yaml": "publisher",
    "trainer.yaml": "trainer-cpu",
    "inference.yaml": "inference-cpu",
    "gpu/trainer.yaml": "trainer",
    "gpu/inference.yaml": "inference",
}
#: Variables compose sets that these manifests leave out on purpose, and why.
NOT_SET = {
    "ARTERY_OTEL_ENDPOINT": "no trace collector is deployed here: the cluster's own (README.md)",
}
#: Services that never open PostgreSQL, though compose hands every service the DSN.
WITHOUT_DATABASE = {"provision", "inference-cpu", "inference"}
#: Names of variables and ConfigMap keys that hold a credential.
SECRET_NAME = re.compile(r"PASSWORD|TOKEN|SECRET|API_KEY|_KEY$|DATABASE_URL|CREDS", re.IGNORECASE)
#: user:password@ in a URL.
CREDENTIAL_IN_URL = re.compile(r"[a-z][a-z0-9+.-]*://[^/\s:@]+:[^/\s@]+@", re.IGNORECASE)


def manifest_files() -> list[Path]:
    return sorted(MANIFESTS.rglob("*.yaml"))


def relative(path: Path) -> str:
    return path.relative_to(MANIFESTS).as_posix()


def documents() -> list[tuple[str, dict]]:
    return [
        (relative(path), document)
        for path in manifest_files()
        for document in yaml.safe_load_all(path.read_text())
        if document
    ]


DOCUMENTS = documents()
WORKLOAD_DOCUMENTS = [(name, d) for name, d in DOCUMENTS if d["kind"] in WORKLOADS]
CONFIG_MAPS = {d["metadata"]["name"]: d for _, d in DOCUMENTS if d["kind"] == "ConfigMap"}


def label(item: tuple[str, dict]) -> str:
    name, document = item
    return f"{name}:{document['kind']}/{document['metadata']['name']}"


def containers(workload: dict) -> list[dict]:
    spec = workload["spec"]["template"]["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


def image_name(image: str) -> str:
    """``artery-slim`` of ``registry.example/artery-slim:1.2``; ``nats:2.10-alpine`` stays whole
    for registry images, whose tag is part of what is deployed."""
    last = image.rsplit("/", 1)[-1]
    name = last.split(":", 1)[0]
    return name if name in ARTERY_IMAGES else last


def container_env(container: dict) -> dict[str, dict]:
    """Every variable the container gets: its ConfigMaps' (envFrom) under its own ``env``."""
    found: dict[str, dict] = {}
    for source in container.get("envFrom", []):
        assert "configMapRef" in source, f"{container['name']}: envFrom only from ConfigMaps"
        for key, value in CONFIG_MAPS[source["configMapRef"]["name"]]["data"].items():
            found[key] = {"name": key, "value": value}
    for variable in container.get("env", []):
        found[variable["name"]] = variable
    return found


def literal_values(container: dict) -> dict[str, str]:
    return {name: v["value"] for name, v in container_env(container).items() if "value" in v}


def volume(workload: dict, name: str) -> dict:
    return next(v for v in workload["spec"]["template"]["spec"].get("volumes", []) if v["name"] == name)


def is_artery(container: dict) -> bool:
    return image_name(container["image"]) in ARTERY_IMAGES


def kind_of(container: dict) -> str:
    """``collector`` for a container that runs ``python -m artery.services.collector``."""
    command = container.get("command", [])
    module = command[command.index("-m") + 1]
    return module.removeprefix("artery.services.").split(".")[0]


# --- Kubernetes' own schemas ---------------------------------------------------------------------


def test_the_directory_holds_every_concern():
    kinds = {(d["kind"], d["metadata"]["name"]) for name, d in DOCUMENTS if "/" not in name}
    expected = {
        ("StatefulSet", "nats"),
        ("Service", "nats"),
        ("Service", "nats-cluster"),
        ("StatefulSet", "postgres"),
        ("Service", "postgres"),
        ("Job", "provision"),
        ("Deployment", "collector"),
        ("Deployment", "reward"),
        ("Deployment", "publisher"),
        ("Deployment", "trainer"),
        ("Deployment", "inference"),
        ("Service", "inference"),
        ("ConfigMap", "artery-env"),
        ("ConfigMap", "nats-config"),
    }
    assert expected <= kinds, f"missing: {expected - kinds}"
    assert not [d for _, d in DOCUMENTS if d["kind"] == "Secret"], "Secrets are generated, never kept here"
    assert set(COMPOSE_SERVICE) == {relative(p) for p in manifest_files()} - {"config.yaml"}


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("item", DOCUMENTS, ids=label)
def test_manifest_follows_the_kubernetes_schema(item, version):
    kubernetes_validate.validate(item[1], version, strict=True)


def test_the_validator_refuses_what_a_cluster_would():
    """The schemas are really applied: a misspelt field and a wrong type are refused."""
    _, workload = next(i for i in WORKLOAD_DOCUMENTS if i[1]["metadata"]["name"] == "collector")
    misspelt = yaml.safe_load(yaml.safe_dump(workload))
    misspelt["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    wrong_type = yaml.safe_load(yaml.safe_dump(workload))
    wrong_type["spec"]["replicas"] = "two"
    for document in (misspelt, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(document, VERSIONS[-1], strict=True)


# --- probes, resources, credentials ------------------------------------------------------------------


@pytest.mark.parametrize("item", [i for i in WORKLOAD_DOCUMENTS if i[1]["kind"] != "Job"], ids=label)
def test_every_container_has_liveness_and_readiness_probes(item):
    for container in containers(item[1]):
        assert container.get("livenessProbe") and container.get("readinessProbe"), container["name"]
        if not is_artery(container):
            continue
        # An Artery service: /healthz (alive) and /readyz (ready) of the server shared.health
        # runs on its metrics port, on every interface of the pod.
        kind = kind_of(container)
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        env = literal_values(container)
        metrics_port = int(env[f"ARTERY_{kind.upper()}_METRICS_PORT"])
        assert ports["metrics"] == metrics_port
        assert env["ARTERY_METRICS_HOST"] in ("0.0.0.0", "::")
        for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
            get = container[probe]["httpGet"]
            assert (get["path"], get["port"]) == (path, "metrics"), (container["name"], probe)
        startup = container.get("startupProbe")
        if startup is not None:
            assert startup["httpGet"]["path"] == "/healthz", "starting is alive, not ready"


@pytest.mark.parametrize("item", WORKLOAD_DOCUMENTS, ids=label)
def test_every_container_requests_resources_and_limits_memory(item):
    for container in containers(item[1]):
        resources = container.get("resources", {})
        assert {"cpu", "memory"} <= set(resources.get("requests", {})), container["name"]
        assert "memory" in resources.get("limits", {}), container["name"]


@pytest.mark.parametrize("name", ["gpu/trainer.yaml", "gpu/inference.yaml"])
def test_gpu_variants_request_a_gpu_and_replace_the_cpu_deployment(name):
    gpu = next(d for n, d in WORKLOAD_DOCUMENTS if n == name)
    cpu = next(d for n, d in WORKLOAD_DOCUMENTS if n == name.removeprefix("gpu/"))
    assert (gpu["kind"], gpu["metadata"]["name"]) == (cpu["kind"], cpu["metadata"]["name"])
    (container,) = containers(gpu)
    resources = container["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == 1
    assert literal_values(container)[f"ARTERY_{kind_of(container).upper()}_DEVICE"] == "cuda"
    assert not any("nvidia.com/gpu" in c.get("resources", {}).get("limits", {}) for c in containers(cpu))


def test_no_credential_is_written_in_the_manifests():
    for path in manifest_files():
        text = path.read_text()
        assert not CREDENTIAL_IN_URL.search(text), f"{relative(path)}: a URL with a password"
    for name, config_map in CONFIG_MAPS.items():
        secret_keys = [k for k in config_map["data"] if SECRET_NAME.search(k) and not k.endswith("_FILE")]
        assert not secret_keys, f"ConfigMap {name} holds credentials: {secret_keys}"
    for name, workload in WORKLOAD_DOCUMENTS:
        for container in containers(workload):
            for variable, value in literal_values(container).items():
                if SECRET_NAME.search(variable) and not variable.endswith("_FILE"):
                    pytest.fail(f"{name}: {variable} is a literal ({value!r}), not from a Secret")


@pytest.mark.parametrize("item", [i for i in WORKLOAD_DOCUMENTS if is_artery(containers(i[1])[0])], ids=label)
def test_each_service_mounts_its_own_nats_password_only(item):
    (container,) = containers(item[1])
    env = literal_values(container)
    user = env["ARTERY_NATS_USER"]
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == "/run/artery/nats")
    assert mount.get("readOnly") is True
    source = volume(item[1], mount["name"])["secret"]
    assert source["secretName"] == f"artery-nats-{user}"
    assert env["ARTERY_NATS_PASSWORD_FILE"] == "/run/artery/nats/password"
    # The Secret holds one key, `password`, which the volume shows as that file.
    assert not source.get("items")
    volumes = item[1]["spec"]["template"]["spec"]["volumes"]
    secrets = [v["secret"]["secretName"] for v in volumes if "secret" in v]
    assert [s for s in secrets if s.startswith("artery-nats-")] == [f"artery-nats-{user}"]
    url = urlsplit(env["ARTERY_NATS_URL"])
    assert (url.scheme, url.hostname, url.port, url.username) == ("nats", "nats", 4222, None)


def test_trainer_and_publisher_share_no_volume():
    """The trainer's output reaches the publisher through NATS alone: its checkpoint directory is
    scratch space of its own pod, and no claim or host path is mounted by both."""
    workloads = {d["metadata"]["name"]: d for n, d in WORKLOAD_DOCUMENTS if "/" not in n}
    trainer, publisher = workloads["trainer"], workloads["publisher"]
    checkpoints = literal_values(containers(trainer)[0])["ARTERY_TRAINER_CHECKPOINT_DIR"]
    mount = next(m for m in containers(trainer)[0]["volumeMounts"] if m["mountPath"] == checkpoints)
    assert "emptyDir" in volume(trainer, mount["name"])

    def shared(workload: dict) -> set[str]:
        names = set()
        for v in workload["spec"]["template"]["spec"].get("volumes", []):
            if "persistentVolumeClaim" in v:
                names.add(f"pvc:{v['persistentVolumeClaim']['claimName']}")
            if "hostPath" in v:
                names.add(f"host:{v['hostPath']['path']}")
        return names

    assert not shared(trainer) & shared(publisher)
    assert not shared(trainer) and not shared(publisher), "a pod's disk is its own"


# --- the same images and settings as compose ------------------------------------------------------


@pytest.mark.parametrize("name", sorted(COMPOSE_SERVICE))
def test_images_are_the_ones_compose_builds(name):
    compose = SERVICES[COMPOSE_SERVICE[name]]
    expected = image_name(compose["image"])
    for _, workload in (i for i in WORKLOAD_DOCUMENTS if i[0] == name):
        for container in containers(workload):
            assert image_name(container["image"]) == expected, (name, container["image"], compose["image"])
            if is_artery(container):
                assert container["command"] == compose["command"], name


ARTERY_FILES = sorted(n for n in COMPOSE_SERVICE if n not in ("nats.yaml", "postgres.yaml"))


@pytest.mark.parametrize("name", ARTERY_FILES)
def test_every_variable_compose_sets_is_set(name):
    compose = environment(SERVICES[COMPOSE_SERVICE[name]])
    (workload,) = [d for n, d in WORKLOAD_DOCUMENTS if n == name]
    (container,) = containers(workload)
    env = container_env(container)
    for variable, value in compose.items():
        if not value:  # passed through or empty by default (an API key, HF_TOKEN): optional
            continue
        if variable in NOT_SET:
            continue
        if variable == "ARTERY_DATABASE_URL" and COMPOSE_SERVICE[name] in WITHOUT_DATABASE:
            continue
        assert variable in env or f"{variable}_FILE" in env, f"{name}: compose sets {variable}, this does not"
        ref = env.get(variable, {}).get("valueFrom", {}).get("secretKeyRef")
        if ref is not None:
            assert not ref.get("optional") or not value, f"{name}: {variable} may be missing"


@pytest.mark.parametrize("item", [i for i in WORKLOAD_DOCUMENTS if is_artery(containers(i[1])[0])], ids=label)
def test_every_artery_variable_is_a_setting_with_a_valid_value(item):
    (container,) = containers(item[1])
    kind = kind_of(container) if "artery.services." in " ".join(container["command"]) else None
    env = container_env(container)
    artery = {name for name in env if name.startswith("ARTERY_")}
    known = COMMON_NAMES | (SERVICE_NAMES.get(kind, set()) | metrics_variables(kind) if kind else set())
    known |= {"ARTERY_METRICS_HOST"}  # in the shared ConfigMap; the provision Job ignores it
    assert artery - known == set(), f"{label(item)}: not settings (see `artery config`)"
    values = literal_values(container)
    # What comes from a Secret is a DSN or a password: a stand-in of the same shape.
    values |= {n: "postgresql://u:p@postgres:5432/artery" for n in env if n == "ARTERY_DATABASE_URL"}
    load(CommonSettings, "ARTERY_", values)
    if kind in SETTINGS:
        cls, prefix = SETTINGS[kind]
        load(cls, prefix, values)


def test_secrets_the_manifests_read_are_the_ones_the_harness_generates(tmp_path):
    """``loadtests/kube/secrets.py`` (and the README's commands) make every Secret a workload
    needs; only optional ones (a judge's key, a hub token) may be missing."""
    from loadtests.kube import secrets

    generated = set(secrets.generate(tmp_path, "demo"))
    needed, optional = set(), set()
    for _, workload in WORKLOAD_DOCUMENTS:
        for v in workload["spec"]["template"]["spec"].get("volumes", []):
            if "secret" in v:
                (optional if v["secret"].get("optional") else needed).add(v["secret"]["secretName"])
        for container in containers(workload):
            for variable in container.get("env", []):
                ref = variable.get("valueFrom", {}).get("secretKeyRef")
                if ref is not None:
                    (optional if ref.get("optional") else needed).add(ref["name"])
    assert needed <= generated, f"not generated: {needed - generated}"
    assert "artery-nats-agent-demo" in generated  # for agents; no workload mounts it
    readme = (MANIFESTS / "README.md").read_text()
    loop = re.search(r"^for user in ([^;]+); do$", readme, re.MULTILINE)
    assert loop, "README.md: the loop creating artery-nats-<user>"
    for name in needed | optional:
        if name.startswith("artery-nats-"):
            assert name.removeprefix("artery-nats-") in loop[1].split(), f"README.md's loop misses {name}"
        else:
            assert f"create secret generic {name} " in readme, f"README.md: how to create the Secret {name}"


def test_podman_rendering_keeps_every_pod_and_its_names(tmp_path):
    """What `make kube-test` plays: one pod per replica, with the DNS names a cluster gives."""
    from loadtests.kube import secrets

    generated = secrets.generate(tmp_path / "generated", "demo")
    plans = {p.name: p for p in render.plan(render.load_manifests(), tmp_path / "secrets", set(generated))}
    assert {"nats-0", "nats-1", "nats-2", "postgres-0", "provision", "trainer-0"} <= set(plans)
    assert {"nats", "nats-cluster", "nats-1.nats-cluster"} <= set(plans["nats-1"].aliases)
    assert "inference" in plans["inference-1"].aliases
    nats_conf = CONFIG_MAPS["nats-config"]["data"]["nats.conf"]
    for index in range(3):
        assert f"nats-route://nats-{index}.nats-cluster:6222" in nats_conf
    for plan in plans.values():
        for container in plan.containers():
            assert container["image"].startswith("localhost/"), "local builds only: nothing pulled"
            assert "ports" not in container
