"""NATS credentials and TLS for ``bus.connect``, from the environment or from files.

- ``ARTERY_NATS_USER`` with ``ARTERY_NATS_PASSWORD`` or ``ARTERY_NATS_PASSWORD_FILE`` (a file:
  docker secrets; a trailing newline is dropped);
- ``ARTERY_NATS_TOKEN`` or ``ARTERY_NATS_TOKEN_FILE``;
- ``ARTERY_NATS_CREDS``: a credentials file (JWT + NKey seed; ``CommonSettings.nats_creds``);
- ``ARTERY_NATS_TLS_CA``: the CA that signed the server's certificate; ``ARTERY_NATS_TLS_CERT``
  and ``ARTERY_NATS_TLS_KEY``: a client certificate (mutual TLS);
- ``ARTERY_NATS_INBOX_PREFIX``: the reply inbox prefix; ``_INBOX.<user>`` when a user is set.

Credentials in the URL (``nats://user:password@host:4222``) work too. A user gets the inbox
prefix its generated permissions allow (``permissions.inbox_prefix``), so replies to one client
are never readable by another.
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated

import msgspec

from artery.shared.errors import ConfigError
from artery.shared.permissions import inbox_prefix
from artery.shared.settings import CommonSettings, doc, load

PREFIX = "ARTERY_NATS_"


class NatsAuthSettings(msgspec.Struct, kw_only=True, frozen=True):
    """Read with prefix ``ARTERY_NATS_``."""

    user: Annotated[str | None, doc("NATS user name")] = None
    password: Annotated[str | None, doc("NATS password (or ARTERY_NATS_PASSWORD_FILE)")] = None
    password_file: Annotated[str | None, doc("file holding the NATS password (docker secrets)")] = None
    token: Annotated[str | None, doc("NATS token (or ARTERY_NATS_TOKEN_FILE)")] = None
    token_file: Annotated[str | None, doc("file holding the NATS token")] = None
    tls_ca: Annotated[str | None, doc("CA certificate (PEM) that signed the server's certificate")] = None
    tls_cert: Annotated[str | None, doc("client certificate (PEM) for mutual TLS")] = None
    tls_key: Annotated[str | None, doc("private key (PEM) of the client certificate")] = None
    inbox_prefix: Annotated[str | None, doc("reply inbox prefix; default _INBOX.<user> with a user")] = None


def secret_value(value: str | None, path: str | None, name: str) -> str | None:
    """A secret given as ``<name>`` (``value``) or in the file ``<name>_FILE`` (``path``)."""
    if value and path:
        raise ConfigError(f"set {name} or {name}_FILE, not both")
    if not path:
        return value
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read {name}_FILE: {exc}") from exc
    secret = text.rstrip("\r\n")  # secrets files usually end with a newline
    if not secret:
        raise ConfigError(f"{name}_FILE {path!r} is empty")
    return secret


def tls_context(auth: NatsAuthSettings) -> ssl.SSLContext | None:
    """A client TLS context when any TLS setting is given, else None."""
    if not (auth.tls_ca or auth.tls_cert or auth.tls_key):
        return None
    if bool(auth.tls_cert) != bool(auth.tls_key):
        raise ConfigError("ARTERY_NATS_TLS_CERT and ARTERY_NATS_TLS_KEY go together")
    try:
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=auth.tls_ca)
        if auth.tls_cert:
            context.load_cert_chain(auth.tls_cert, auth.tls_key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"NATS TLS files: {exc}") from exc
    return context


def nats_connect_options(
    settings: CommonSettings, environ: Mapping[str, str] | None = None
) -> dict[str, object]:
    """Keyword arguments for ``nats.connect``: credentials, TLS, inbox prefix (only what is set)."""
    auth = load(NatsAuthSettings, PREFIX, environ)
    password = secret_value(auth.password, auth.password_file, f"{PREFIX}PASSWORD")
    token = secret_value(auth.token, auth.token_file, f"{PREFIX}TOKEN")
    if token and auth.user:
        raise ConfigError("set a NATS user and password or a token, not both")
    if bool(auth.user) != bool(password):
        raise ConfigError("ARTERY_NATS_USER needs ARTERY_NATS_PASSWORD (or _FILE), and the reverse")
    options: dict[str, object] = {}
    if settings.nats_creds:
        options["user_credentials"] = settings.nats_creds
    if auth.user:
        options["user"], options["password"] = auth.user, password
    if token:
        options["token"] = token
    context = tls_context(auth)
    if context is not None:
        options["tls"] = context
    prefix = auth.inbox_prefix or (inbox_prefix(auth.user) if auth.user else None)
    if prefix:
        options["inbox_prefix"] = prefix
    return options
