"""``python -m loadtests.compose`` (``make compose-test``): the compose deployment, built and run
with podman on this host, checked end to end, and cleaned up.

1. Sets up what it needs: podman, runc and debootstrap (apt-get) when missing; podman-compose
   from PyPI in a virtualenv of its own; a containers.conf of its own (``CONTAINERS_CONF``).
2. Builds a Debian base image with debootstrap (the mirror APT uses here), then the project's
   images from the unchanged Dockerfiles (``PYTHON_IMAGE`` = that base; pip inside the builds
   uses the host's pip configuration, bind-mounted) and the stand-ins for the registry's images
   (compose/standins/). Images are kept, so a second run reuses them (``--remove-images``: not).
3. Starts the ``cpu`` profile of compose/compose.yaml with compose/compose.standins.yaml over it,
   waits for every health check, and runs the scenario (``scenario.py``): 2 training steps from
   an agent on the host with a service SIGKILLed, the NATS users held to their roles, one trace
   across the containers, then ``down`` and ``up`` with nothing lost.
4. Removes its containers, volumes and network, even when a check failed (``--keep-running``:
   leave them up to look at).

The figures (build times, image sizes, time to healthy, the whole run) are printed and written
to loadtests/results/compose.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from loadtests import RESULTS_DIR
from loadtests.compose import scenario
from loadtests.compose.deployment import Deployment
from loadtests.compose.podman import (
    BASE_IMAGE,
    COMPOSE_DIR,
    ROOT,
    STANDINS_DIR,
    WORK,
    PipForBuilds,
    Podman,
    build_base_image,
    build_image,
    ensure_tools,
    log,
)

PODMAN_COMPOSE = "podman-compose==1.6.0"
#: tag -> (Dockerfile, build context); the stand-ins build FROM the base image.
PROJECT_IMAGES = {
    "localhost/artery-slim:latest": (COMPOSE_DIR / "Dockerfile.slim", ROOT),
    "localhost/artery-cpu:latest": (COMPOSE_DIR / "Dockerfile.cpu", ROOT),
}
STANDIN_IMAGES = {
    f"localhost/artery-standin-{name}:latest": (STANDINS_DIR / f"{name}.Containerfile", STANDINS_DIR)
    for name in ("nats", "postgres", "otlp-recorder")
}


def podman_compose() -> str:
    venv = WORK / "venv"
    executable = venv / "bin" / "podman-compose"
    if not executable.exists():
        log(f"installing {PODMAN_COMPOSE} into {venv.relative_to(ROOT)}")
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", PODMAN_COMPOSE], check=True)
    return str(executable)


def build_all(podman: Podman, results: dict) -> None:
    seconds = build_base_image(podman)
    results["build_s"] = {"base": round(seconds, 1) if seconds is not None else "cached"}
    pip = PipForBuilds.from_host(podman.work)
    for tag, (dockerfile, context) in {**STANDIN_IMAGES, **PROJECT_IMAGES}.items():
        args = (
            {"BASE_IMAGE": BASE_IMAGE}
            if tag in STANDIN_IMAGES
            else {"PYTHON_IMAGE": BASE_IMAGE, **pip.build_args}
        )
        results["build_s"][tag] = round(build_image(podman, tag, dockerfile, context, args, pip.volumes), 1)
    results["image_mb"] = {
        tag: round(podman.image_size_mb(tag)) for tag in [BASE_IMAGE, *STANDIN_IMAGES, *PROJECT_IMAGES]
    }
    log(f"image sizes (MB): {results['image_mb']}")


#: Run inside each project image: the contract and the migrations are there, no build tools,
#: no pip cache, no source tree, nothing secret.
HYGIENE = """
import importlib.resources as r, os, shutil, sys
assert (r.files("artery.schemas") / "generated" / "asyncapi.json").is_file(), "no asyncapi.json"
assert len([p for p in (r.files("artery.shared") / "migrations").iterdir() if p.name.endswith(".sql")]) >= 1
tools = [t for t in ("gcc", "cc", "make", "git", "apt-get-build-dep") if shutil.which(t)]
assert not tools, f"build tools: {tools}"
for path in (os.path.expanduser("~root/.cache/pip"), os.path.expanduser("~/.cache/pip"), "/src"):
    assert not os.path.exists(path), f"left from the build: {path}"
# `podman build -v` leaves its mount points behind, empty: nothing of the build host inside.
for path in sys.argv[1:]:
    if os.path.isfile(path):
        assert os.path.getsize(path) == 0, f"{path}: content from the build"
    elif os.path.isdir(path):
        assert not os.listdir(path), f"{path}: content from the build"
secrets = [k for k in os.environ if any(w in k for w in ("PASSWORD", "SECRET", "TOKEN", "API_KEY"))]
assert not secrets, f"secrets in the image's environment: {secrets}"
print(os.getuid())
"""


def check_images(podman: Podman) -> None:
    pip = PipForBuilds.from_host(podman.work)
    for tag in PROJECT_IMAGES:
        info = json.loads(podman.output("image", "inspect", tag))[0]
        config = info["Config"]
        scenario.check(config.get("User") == "artery", f"{tag} runs as user artery, not root")
        health = (info.get("Healthcheck") or config.get("Healthcheck") or {}).get("Test") or []
        scenario.check("/readyz" in " ".join(health), f"{tag}: HEALTHCHECK asks /readyz ({health[-1:]})")
        mounts = [v.split(":")[1] for v in pip.volumes if not v.split(":")[1].startswith("/etc/ssl")]
        uid = podman.output("run", "--rm", "--entrypoint", "python", tag, "-c", HYGIENE, *mounts)
        scenario.check(
            uid == "10001", f"{tag}: contract and migrations inside; no build tools, caches or secrets"
        )
        layers = podman.output("history", "--format", "{{.CreatedBy}}", tag)
        scenario.check(
            "pip install" not in layers, f"{tag}: multi-stage (no pip install layer in the final image)"
        )


async def run_scenario(deployment: Deployment, results: dict) -> None:
    with tempfile.TemporaryDirectory(prefix="compose-agent-") as base_path:
        backend = await scenario.training_with_a_kill(deployment, Path(base_path), results)
        await scenario.users_hold_to_their_roles(deployment)
        await scenario.one_trace_crosses_the_containers(deployment, results)
        await scenario.survives_down_and_up(deployment, backend, results)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.compose", description=__doc__.splitlines()[0])
    parser.add_argument("--keep-running", action="store_true", help="leave the deployment up at the end")
    parser.add_argument("--remove-images", action="store_true", help="remove the images built too")
    parser.add_argument("--no-build", action="store_true", help="use the images already built")
    parser.add_argument("--project", default="artery-composetest", help="compose project name")
    args = parser.parse_args(argv)
    started = time.monotonic()
    results: dict = {"ok": False}
    ensure_tools()
    podman = Podman()
    deployment = Deployment(podman, podman_compose(), project=args.project)
    deployment.down(volumes=True)  # what an interrupted earlier run left
    try:
        if not args.no_build:
            build_all(podman, results)
        check_images(podman)
        up_started = time.monotonic()
        deployment.up()
        log("up; waiting for every health check")
        healthy = deployment.wait_healthy()
        results["time_to_healthy_s"] = round(time.monotonic() - up_started, 1)
        results["healthy_after_s"] = {k: round(v, 1) for k, v in healthy.items()}
        asyncio.run(run_scenario(deployment, results))
        results["ok"] = True
    except Exception as exc:
        results["error"] = f"{type(exc).__name__}: {exc}"
        log(f"FAILED: {results['error']}")
        for service in deployment.containers():
            print(f"--- podman logs {service} (last lines)\n{deployment.logs(service, 15)}", file=sys.stderr)
    finally:
        if not args.keep_running:
            deployment.down(volumes=True)
            left = deployment.volumes() + list(deployment.containers())
            results["cleaned_up"] = not left
            if args.remove_images:
                podman.run("rmi", "-f", *PROJECT_IMAGES, *STANDIN_IMAGES, BASE_IMAGE, check=False)
        results["total_s"] = round(time.monotonic() - started, 1)
        RESULTS_DIR.mkdir(exist_ok=True)
        (RESULTS_DIR / "compose.json").write_text(json.dumps(results, indent=2) + "\n")
        log(f"{'ok' if results['ok'] else 'FAILED'} in {results['total_s']:.0f} s: {json.dumps(results)}")
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
