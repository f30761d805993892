"""The images `make kube-test` runs: the project's images and the registry stand-ins, built by
loadtests/compose's builder from the same Dockerfiles, under a tag of their own (``kube``) so that
a `make compose-test` running at the same time on this host keeps its own ``latest`` images."""

from __future__ import annotations

import time

from loadtests.compose.podman import (
    BASE_IMAGE,
    COMPOSE_DIR,
    ROOT,
    STANDINS_DIR,
    PipForBuilds,
    Podman,
    build_base_image,
    build_image,
)

TAG = "kube"
#: image name in kubernetes/ -> the local image kube play runs instead (tag, Dockerfile, context).
PROJECT_IMAGES = {
    "artery-slim": (f"localhost/artery-slim:{TAG}", COMPOSE_DIR / "Dockerfile.slim", ROOT),
    "artery-cpu": (f"localhost/artery-cpu:{TAG}", COMPOSE_DIR / "Dockerfile.cpu", ROOT),
}
#: Registry images of kubernetes/, replaced by compose's stand-ins (compose/standins/).
STANDIN_IMAGES = {
    "nats": (f"localhost/artery-standin-nats:{TAG}", STANDINS_DIR / "nats.Containerfile", STANDINS_DIR),
    "postgres": (
        f"localhost/artery-standin-postgres:{TAG}",
        STANDINS_DIR / "postgres.Containerfile",
        STANDINS_DIR,
    ),
}


def local_image(image: str) -> str:
    """The local tag kube play runs for an image a manifest names (``nats:2.10-alpine``,
    ``artery-slim:latest``); the image itself when it has no stand-in."""
    name = image.rsplit("/", 1)[-1].split(":", 1)[0]
    for images in (PROJECT_IMAGES, STANDIN_IMAGES):
        if name in images:
            return images[name][0]
    return image


def build_all(podman: Podman, results: dict) -> None:
    started = time.monotonic()
    seconds = build_base_image(podman)
    results["build_s"] = {"base": round(seconds, 1) if seconds is not None else "cached"}
    pip = PipForBuilds.from_host(podman.work)
    for tag, dockerfile, context in STANDIN_IMAGES.values():
        results["build_s"][tag] = round(
            build_image(podman, tag, dockerfile, context, {"BASE_IMAGE": BASE_IMAGE}, pip.volumes), 1
        )
    for tag, dockerfile, context in PROJECT_IMAGES.values():
        args = {"PYTHON_IMAGE": BASE_IMAGE, **pip.build_args}
        results["build_s"][tag] = round(build_image(podman, tag, dockerfile, context, args, pip.volumes), 1)
    results["build_s"]["all"] = round(time.monotonic() - started, 1)


def missing(podman: Podman) -> list[str]:
    """Images --no-build needs that are not there."""
    tags = [tag for tag, _, _ in (*PROJECT_IMAGES.values(), *STANDIN_IMAGES.values())]
    return [tag for tag in tags if not podman.image_exists(tag)]
