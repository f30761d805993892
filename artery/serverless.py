"""``art.ServerlessBackend``: ART's one-line swap from local to remote, against a remote Artery.

ART's ``ServerlessBackend(api_key=..., base_url=...)`` trains on a hosted service. Here the
remote is an Artery stack run with per-project NATS users (``artery up --secure``), reached over
NATS, with TLS where the URL says ``tls://``. The API key is one string per project: it carries
the project's agent user and password and the key its inference replicas ask for
(``project_api_key``; ``python -m artery.serverless`` prints it from the environment
``artery up --secure`` prints for the project's agent), so an agent outside the cluster needs
nothing else. Every call then goes the way ``art.Backend``'s go, under that project's permissions.
"""

from __future__ import annotations

import base64
import json
import os
import ssl
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from artery.backend import Backend
from artery.backend_api import TrainResult
from artery.shared.auth import secret_value
from artery.shared.permissions import inbox_prefix

if TYPE_CHECKING:
    from artery.model import Model

#: What every Artery API key starts with, so that a key from elsewhere (W&B's) is told apart.
KEY_PREFIX = "artery_"
API_KEY_ENV, BASE_URL_ENV = "ARTERY_API_KEY", "ARTERY_BASE_URL"
#: The CA that signed the remote NATS server's certificate, where it is not a public one.
TLS_CA_ENV = "ARTERY_NATS_TLS_CA"


@dataclass(frozen=True)
class ProjectKey:
    """What an API key holds: the project's agent user on NATS and its inference key."""

    user: str
    password: str
    inference_key: str | None = None


def encode_api_key(key: ProjectKey) -> str:
    """``artery_`` and the key's fields, base64url: one string, for one environment variable."""
    body = json.dumps({"u": key.user, "p": key.password, "k": key.inference_key}, separators=(",", ":"))
    return KEY_PREFIX + base64.urlsafe_b64encode(body.encode()).decode().rstrip("=")


def decode_api_key(api_key: str) -> ProjectKey:
    """The ``ProjectKey`` in ``api_key``; ``ValueError`` saying what is wrong (never the secret)."""
    text = api_key.strip()
    if not text.startswith(KEY_PREFIX):
        raise ValueError(
            f"an Artery API key starts with {KEY_PREFIX!r} (this one does not: is it another service's?)"
        )
    encoded = text.removeprefix(KEY_PREFIX)
    try:
        fields = json.loads(base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)))
        key = ProjectKey(user=fields["u"], password=fields["p"], inference_key=fields.get("k"))
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError("the Artery API key is damaged (copy it again from `artery up --secure`)") from exc
    if not (isinstance(key.user, str) and key.user and isinstance(key.password, str) and key.password):
        raise ValueError("the Artery API key names no user or password")
    return key


def project_api_key(agent_env: Mapping[str, str]) -> str:
    """The API key of a project, from what its agent is given (``Stack.agent_env(project)``:
    user, password file, inference key file)."""
    password = secret_value(
        agent_env.get("ARTERY_NATS_PASSWORD"),
        agent_env.get("ARTERY_NATS_PASSWORD_FILE"),
        "ARTERY_NATS_PASSWORD",
    )
    inference_key = secret_value(
        agent_env.get("ARTERY_INFERENCE_API_KEY"),
        agent_env.get("ARTERY_INFERENCE_API_KEY_FILE"),
        "ARTERY_INFERENCE_API_KEY",
    )
    if not password:
        raise ValueError("the agent's environment holds no NATS password")
    return encode_api_key(ProjectKey(agent_env["ARTERY_NATS_USER"], password, inference_key))


@dataclass
class ServerlessTrainResult(TrainResult):
    """ART's ``ServerlessTrainResult``: a ``TrainResult`` and the name of the step's checkpoint,
    in ART's ``<project>/<model>:step<N>`` shape (served by Artery as ``<model>@<N>``)."""

    artifact_name: str | None = None


class ServerlessBackend(Backend):
    """A remote Artery, reached with a per-project API key: ``ServerlessBackend(api_key=...,
    base_url="tls://host:4222")``, else ``ARTERY_API_KEY`` and ``ARTERY_BASE_URL``.

    ``tls_ca`` (or ``ARTERY_NATS_TLS_CA``): the CA of the server's certificate where it is not
    one the system trusts. ``inference_url``: the replicas' OpenAI-compatible URL where the one
    they registered is not reachable from here."""

    def __init__(
        self,
        *,
        api_key: str | None = None,
        base_url: str | None = None,
        tls_ca: str | os.PathLike | None = None,
        inference_url: str | None = None,
    ):
        api_key = api_key or os.environ.get(API_KEY_ENV) or None
        base_url = base_url or os.environ.get(BASE_URL_ENV) or None
        if not api_key:
            raise ValueError(f"ServerlessBackend needs an API key: api_key= or {API_KEY_ENV}")
        if not base_url:
            raise ValueError(f"ServerlessBackend needs the remote's NATS URL: base_url= or {BASE_URL_ENV}")
        key = decode_api_key(api_key)
        super().__init__(nats_url=base_url, inference_url=inference_url, inference_api_key=key.inference_key)
        self.user = key.user
        # The caller's options win over ARTERY_NATS_* (``bus.connect``): this key, nobody else's.
        options: dict[str, object] = {
            "user": key.user,
            "password": key.password,
            "inbox_prefix": inbox_prefix(key.user),
        }
        ca = tls_ca or os.environ.get(TLS_CA_ENV) or None
        if ca is not None:
            if not Path(ca).is_file():
                raise ValueError(f"tls_ca {str(ca)!r} is not a file")
            options["tls"] = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(ca))
        self._nats_options = options

    async def train(self, model: Model, *args: Any, **kwargs: Any) -> ServerlessTrainResult:
        """``Backend.train``, returning ART's ``ServerlessTrainResult``."""
        result = await super().train(model, *args, **kwargs)
        artifact = f"{model.project}/{model.name}:step{result.step}"
        return ServerlessTrainResult(**asdict(result), artifact_name=artifact)


def main() -> None:
    """``python -m artery.serverless``: the API key of the project whose agent environment this
    is (the ``ARTERY_*`` line ``artery up --secure`` prints for ``agent-<project>``)."""
    print(project_api_key(os.environ))


if __name__ == "__main__":
    main()
