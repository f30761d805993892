"""Podman on this host, set up from nothing: the tools, a containers.conf, a Debian base image
built with debootstrap, and the image builds with the host's own pip configuration.

Nothing here names a path of a particular machine: the Debian mirror is read from APT's sources
and the package indexes, wheel directories, certificates and constraints from ``pip config
list``, each when it runs.
"""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_DIR = ROOT / "compose"
STANDINS_DIR = COMPOSE_DIR / "standins"
#: Everything this harness keeps between runs (ignored by git: under .artery/).
WORK = ROOT / ".artery" / "compose"
SUITE = "bookworm"  # Debian 12: Python 3.11, the interpreter the local torch wheel is built for
BASE_IMAGE = f"localhost/artery-base-debian:{SUITE}"
BASE_PACKAGES = "python3,python3-venv,python3-pip,python-is-python3,ca-certificates"
#: crun fails on this kind of host (cgroups in hybrid mode; setrlimit refused): runc, cgroupfs,
#: and no default ulimits (raising them is refused inside an unprivileged sandbox).
CONTAINERS_CONF = """\
# Written by loadtests/compose/podman.py for `make compose-test` (CONTAINERS_CONF points here).
[containers]
default_ulimits = []

[engine]
cgroup_manager = "cgroupfs"
runtime = "runc"
"""


def log(message: str) -> None:
    print(f"[compose-test {time.strftime('%H:%M:%S')}] {message}", flush=True)


def debian_mirror(sources_dir: Path = Path("/etc/apt")) -> str:
    """The first Debian archive APT uses for ``SUITE`` (deb822 ``.sources`` files or sources.list)."""
    files = sorted((sources_dir / "sources.list.d").glob("*.sources"))
    for path in files:
        for stanza in path.read_text().split("\n\n"):
            fields = {}
            for line in stanza.splitlines():
                if line and not line.startswith("#") and ":" in line and not line[0].isspace():
                    key, _, value = line.partition(":")
                    fields[key.strip().lower()] = value.split()
            if "deb" in fields.get("types", []) and SUITE in fields.get("suites", []):
                return fields["uris"][0]
    for path in [sources_dir / "sources.list", *sorted((sources_dir / "sources.list.d").glob("*.list"))]:
        if path.exists():
            for line in path.read_text().splitlines():
                words = [w for w in line.split() if not w.startswith("[")]
                if len(words) >= 3 and words[0] == "deb" and words[2] == SUITE:
                    return words[1]
    raise RuntimeError(f"no Debian {SUITE} archive in APT's sources ({sources_dir})")


def ensure_tools() -> None:
    """podman, runc and debootstrap from Debian's packages when one is missing."""
    if os.geteuid() != 0:
        # Rootful podman (runc, cgroupfs, image builds that bind-mount the host's pip config) and
        # debootstrap: said at once rather than half-way through a build.
        raise SystemExit("make compose-test needs root (podman rootful and debootstrap); run it as root")
    missing = [t for t in ("podman", "runc", "debootstrap") if shutil.which(t) is None]
    if not missing:
        return
    log(f"installing {' '.join(missing)} (apt-get)")
    subprocess.run(["apt-get", "update", "-q"], check=True)
    subprocess.run(["apt-get", "install", "-y", "-q", "podman", "runc", "debootstrap"], check=True)


@dataclass
class Podman:
    """The podman CLI with this harness's containers.conf."""

    work: Path = WORK
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        conf = self.work / "containers.conf"
        conf.write_text(CONTAINERS_CONF)
        self.env = {**os.environ, "CONTAINERS_CONF": str(conf)}

    def run(self, *args: str, check: bool = True, capture: bool = False, **kwargs):
        return subprocess.run(
            ["podman", *args], env=self.env, check=check, text=True, capture_output=capture, **kwargs
        )

    def output(self, *args: str) -> str:
        return self.run(*args, capture=True).stdout.strip()

    def image_exists(self, name: str) -> bool:
        return self.run("image", "exists", name, check=False).returncode == 0

    def image_size_mb(self, name: str) -> float:
        return int(self.output("image", "inspect", "--format", "{{.Size}}", name)) / 1e6


#: As Debian's own -slim images: no manuals, documentation (but licences) or translations, in
#: the base and in whatever a later ``apt-get install`` adds.
DPKG_EXCLUDES = """\
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
"""


def slim_base(rootfs: Path) -> None:
    """Drop what only the installation needed (downloaded packages, APT's indexes and caches)
    and the documentation, and keep later installs from adding documentation back."""
    (rootfs / "etc/dpkg/dpkg.cfg.d/excludes").write_text(DPKG_EXCLUDES)
    for pattern in (
        "var/cache/apt/archives/*.deb",
        "var/cache/apt/*.bin",
        "var/lib/apt/lists/*_*",
        "usr/share/man/*",
        "usr/share/info/*",
        "usr/share/locale/*",
        "usr/share/doc/*/*",
    ):
        for path in rootfs.glob(pattern):
            if path.name == "copyright" or path.is_symlink() or not path.exists():
                continue
            shutil.rmtree(path) if path.is_dir() else path.unlink()


def build_base_image(podman: Podman) -> float | None:
    """Debian ``SUITE`` (minbase, Python, CA certificates) imported as ``BASE_IMAGE``; seconds
    taken, or None when it was already there."""
    if podman.image_exists(BASE_IMAGE):
        return None
    # DEBIAN_MIRROR chooses; else the host's own archive (what is reachable here); else Debian's.
    try:
        mirror = os.environ.get("DEBIAN_MIRROR") or debian_mirror()
    except RuntimeError as exc:  # not a Debian 12 host: the public archive, if it can be reached
        mirror = "http://deb.debian.org/debian"
        log(f"{exc}; using {mirror} (set DEBIAN_MIRROR to choose)")
    started = time.monotonic()
    log(f"debootstrap {SUITE} from {mirror} -> {BASE_IMAGE}")
    with tempfile.TemporaryDirectory(dir=podman.work, prefix="rootfs-") as rootfs:
        subprocess.run(
            ["debootstrap", "--variant=minbase", f"--include={BASE_PACKAGES}", SUITE, rootfs, mirror],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        slim_base(Path(rootfs))
        tar = subprocess.Popen(["tar", "-C", rootfs, "-c", "."], stdout=subprocess.PIPE)
        podman.run("import", "--change", 'CMD=["python3"]', "-", BASE_IMAGE, stdin=tar.stdout)
        tar.wait()
    return time.monotonic() - started


# --- pip inside the builds ------------------------------------------------------------------------


def host_pip_config() -> dict[str, str]:
    """``pip config list`` of this host, environment variables over files (``global`` or ``install``)."""
    listing = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True
    ).stdout
    ranked: dict[str, tuple[int, str]] = {}
    for line in listing.splitlines():
        key, _, value = line.partition("=")
        section, _, name = key.rpartition(".")
        rank = {":env:": 3, "install": 2, "global": 1}.get(section)
        if rank and (name not in ranked or ranked[name][0] < rank):
            ranked[name] = (rank, value.strip().strip("'\""))
    return {name: value for name, (_, value) in ranked.items()}


@dataclass
class PipForBuilds:
    """The host's pip configuration, handed to ``RUN pip install`` by bind mounts: a pip.conf at
    /etc/pip.conf, and each local file it names (wheel directories, file:// indexes, the CA
    bundle, a constraints file) at the same path, read-only. Nothing of it stays in an image."""

    volumes: list[str]
    build_args: dict[str, str]
    local_wheels: bool

    @classmethod
    def from_host(cls, work: Path) -> PipForBuilds:
        config = host_pip_config()
        keep = ("index-url", "extra-index-url", "find-links", "cert", "constraint", "default-timeout")
        paths: set[str] = set()
        for name in ("index-url", "extra-index-url", "find-links"):
            for entry in config.get(name, "").split():
                local = urlsplit(entry).path if entry.startswith("file:") else entry
                if local.startswith("/"):
                    # A file:// index links to its files by relative paths, commonly beside it
                    # (``<dir>/simple`` and ``<dir>/files``): its parent goes in whole.
                    paths.add(str(Path(local).parent) if name != "find-links" else local)
        for name in ("cert", "constraint"):
            if config.get(name, "").startswith("/"):
                paths.add(config[name])
        parser = configparser.ConfigParser()
        parser["global"] = {k: config[k] for k in keep if config.get(k)}
        conf = work / "pip.conf"
        with conf.open("w") as handle:
            handle.write("# Written by loadtests/compose/podman.py: the host's pip configuration.\n")
            parser.write(handle)
        volumes = [f"{conf}:/etc/pip.conf:ro"]
        volumes += [f"{os.path.realpath(p)}:{p}:ro" for p in sorted(paths) if os.path.exists(p)]
        if not config.get("cert"):
            volumes.append("/etc/ssl/certs:/etc/ssl/certs:ro")  # the host's CA bundle (a proxy's CA)
        # With local wheels or indexes, torch's CPU build is among them (as on this host, where
        # download.pytorch.org is out of reach): the Dockerfile's extra index becomes the host's
        # own index, and pip finds the local wheel through the mounted configuration.
        local = any(not v.startswith("/etc/ssl") and "pip.conf" not in v for v in volumes)
        build_args = {}
        if os.environ.get("TORCH_INDEX_URL"):
            build_args["TORCH_INDEX_URL"] = os.environ["TORCH_INDEX_URL"]
        elif local:
            build_args["TORCH_INDEX_URL"] = config.get("index-url") or "https://pypi.org/simple"
        return cls(volumes=volumes, build_args=build_args, local_wheels=local)


def build_image(
    podman: Podman,
    tag: str,
    dockerfile: Path,
    context: Path,
    build_args: dict[str, str],
    volumes: list[str] = (),
) -> float:
    """``podman build`` (layers cached: a second build of unchanged sources takes seconds)."""
    started = time.monotonic()
    # Docker's image format: the OCI format has no HEALTHCHECK, and podman would drop it.
    command = ["build", "--layers", "--format", "docker", "-t", tag, "-f", str(dockerfile)]
    for name, value in build_args.items():
        command += ["--build-arg", f"{name}={value}"]
    for volume in volumes:
        command += ["-v", volume]
    output = podman.work / f"build-{tag.rsplit('/', 1)[-1].split(':')[0]}.log"
    log(f"build {tag} ({dockerfile.relative_to(ROOT)}; output in {output.relative_to(ROOT)})")
    with output.open("w") as handle:
        result = podman.run(*command, str(context), check=False, stdout=handle, stderr=subprocess.STDOUT)
    if result.returncode:
        tail = "".join(output.read_text().splitlines(keepends=True)[-30:])
        raise RuntimeError(f"podman build {tag} failed ({result.returncode}):\n{tail}")
    return time.monotonic() - started
