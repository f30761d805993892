"""The Secrets the manifests read, generated as an operator would (kubernetes/README.md,
"Secrets"): NATS users and their passwords from ``artery nats-config``, PostgreSQL's password
and the DSN built from it. Nothing here is kept after the run."""

from __future__ import annotations

import base64
import json
import os
import secrets
from pathlib import Path

from artery.ops import cli

#: The users the services connect as (each one's Secret: artery-nats-<user>).
SERVICE_USERS = ("admin", "collector", "reward", "trainer", "publisher", "inference")
POSTGRES_HOST = "postgres"


def generate(directory: Path, project: str) -> dict[str, dict[str, str]]:
    """Secret name -> {key: value} for every Secret kubernetes/ names (but the optional ones)."""
    nats_dir = directory / "nats-config"
    users_conf = directory / "users.conf"
    cli.main(
        ["nats-config", "--project", project, "--secrets-dir", str(nats_dir), "--output", str(users_conf)]
    )
    values = {"nats-users": {"users.conf": users_conf.read_text()}}
    for user in (*SERVICE_USERS, f"agent-{project}"):
        values[f"artery-nats-{user}"] = {"password": (nats_dir / user).read_text().strip()}
    # URL-safe: the password goes into the DSN as it is.
    password = secrets.token_urlsafe(24)
    values["artery-postgres"] = {
        "password": password,
        "database-url": f"postgresql://artery:{password}@{POSTGRES_HOST}:5432/artery",
    }
    return values


def manifests(values: dict[str, dict[str, str]]) -> list[dict]:
    """The same as Kubernetes Secret objects (``kubectl apply -f -``)."""
    return [
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": name, "labels": {"app.kubernetes.io/part-of": "artery"}},
            "type": "Opaque",
            "data": {key: base64.b64encode(value.encode()).decode() for key, value in data.items()},
        }
        for name, data in values.items()
    ]


def env_secret(data: dict[str, str]) -> bytes:
    """What podman 4.3 reads for ``secretKeyRef``: a JSON object of base64 values."""
    encoded = {key: base64.b64encode(value.encode()).decode() for key, value in data.items()}
    return json.dumps(encoded).encode()


def write_files(values: dict[str, dict[str, str]], directory: Path, owner: int = 10001) -> None:
    """Each Secret as a directory of files (what a secret volume holds), readable by ``owner``
    only: the pods' user (the images' ``artery``; nats-server runs as root)."""
    for name, data in values.items():
        folder = directory / name
        folder.mkdir(parents=True, exist_ok=True)
        for key, value in data.items():
            path = folder / key
            path.write_text(value if value.endswith("\n") else value + "\n")
            os.chmod(path, 0o400)
            os.chown(path, owner, owner)
        os.chmod(folder, 0o500)
        os.chown(folder, owner, owner)
