"""``art.ServerlessBackend``: ART's remote backend as a client of a remote Artery, reached with a
per-project API key over NATS (TLS where the URL says so)."""

from __future__ import annotations

import asyncio
import datetime as dt
import ipaddress
from pathlib import Path

import nats
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

import artery as art
from artery.serverless import ProjectKey, decode_api_key, encode_api_key, project_api_key
from artery.shared import bus
from artery.shared.embedded import NatsServer
from artery.shared.models import TINY
from artery.shared.permissions import default_users, render_authorization
from artery.shared.settings import CommonSettings
from artery.testing.agents import half_alphabet_rollout

PROJECT, MODEL = "remote.p", "agent-2.0"


def test_an_api_key_round_trips_and_a_foreign_or_damaged_one_is_refused():
    key = ProjectKey(user="agent-p", password="s3cr=t/+", inference_key="inf")
    encoded = encode_api_key(key)
    assert encoded.startswith("artery_") and decode_api_key(encoded) == key
    with pytest.raises(ValueError, match="starts with 'artery_'"):
        decode_api_key("wandb-0123456789")
    with pytest.raises(ValueError, match="damaged") as refused:
        decode_api_key("artery_" + encoded[9:-3])
    assert key.password not in str(refused.value)


def test_the_key_and_url_come_from_the_environment_and_are_required(monkeypatch):
    monkeypatch.delenv("ARTERY_API_KEY", raising=False)
    monkeypatch.delenv("ARTERY_BASE_URL", raising=False)
    with pytest.raises(ValueError, match="ARTERY_API_KEY"):
        art.ServerlessBackend(base_url="nats://127.0.0.1:4222")
    key = encode_api_key(ProjectKey(user="agent-p", password="pw", inference_key="inf"))
    with pytest.raises(ValueError, match="ARTERY_BASE_URL"):
        art.ServerlessBackend(api_key=key)
    monkeypatch.setenv("ARTERY_API_KEY", key)
    monkeypatch.setenv("ARTERY_BASE_URL", "tls://example.invalid:4222")
    backend = art.ServerlessBackend()
    assert backend.settings.nats_url == "tls://example.invalid:4222"
    assert backend.inference_api_key == "inf" and backend.user == "agent-p"


def _certificates(directory: Path) -> tuple[Path, Path, Path]:
    """A CA, and a certificate it signed for 127.0.0.1: (ca, cert, key) PEM files."""
    now = dt.datetime.now(dt.UTC)

    def build(subject: str, issuer: x509.Name | None, signer, public_key, *, ca: bool) -> x509.Certificate:
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
        builder = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(issuer or name)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            san = x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
            builder = builder.add_extension(san, critical=False)
        return builder.sign(signer, hashes.SHA256())

    ca_key, server_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = build("artery test CA", None, ca_key, ca_key.public_key(), ca=True)
    server = build("127.0.0.1", ca.subject, ca_key, server_key.public_key(), ca=False)
    paths = directory / "ca.pem", directory / "server.pem", directory / "server-key.pem"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(server.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        server_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return paths


async def test_over_tls_the_key_connects_and_the_servers_certificate_is_checked(tmp_path):
    ca, cert, key_file = _certificates(tmp_path)
    users = default_users([PROJECT])
    passwords = {u.name: u.password for u in users}
    tls = f'tls {{ cert_file: "{cert}", key_file: "{key_file}", ca_file: "{ca}" }}\n'
    with NatsServer(tmp_path / "nats", extra_config=tls + render_authorization(users)) as server:
        url = f"tls://127.0.0.1:{server.port}"
        # Streams are the operator's to create (admin), as on a secure stack.
        settings = CommonSettings(nats_url=url)
        admin = await nats.connect(
            url, user="admin", password=passwords["admin"], inbox_prefix="_INBOX.admin", tls=_context(ca)
        )
        await bus.provision(admin.jetstream(), settings)
        await admin.close()

        agent = f"agent-{PROJECT}"
        api_key = encode_api_key(ProjectKey(user=agent, password=passwords[agent]))
        backend = art.ServerlessBackend(api_key=api_key, base_url=url, tls_ca=ca)
        try:
            nc = await backend._connect()
            assert nc.is_connected and nc.connected_url is not None and nc.connected_url.scheme == "tls"
            assert nc._server_info.get("tls_required") is True
        finally:
            await backend.close()
        # Without the CA, the server's certificate is not trusted: no connection, no credentials sent.
        untrusting = art.ServerlessBackend(api_key=api_key, base_url=url)
        untrusting._nats_options["allow_reconnect"] = False  # fail at once
        with pytest.raises(Exception, match=r"CERTIFICATE_VERIFY_FAILED|certificate verify failed"):
            await asyncio.wait_for(untrusting._connect(), 30)
        await untrusting.close()
        # Another key is refused by the server.
        wrong = encode_api_key(ProjectKey(user=agent, password="not-the-password"))
        forged = art.ServerlessBackend(api_key=wrong, base_url=url, tls_ca=ca)
        forged._nats_options["allow_reconnect"] = False  # fail at once
        with pytest.raises(Exception, match=r"[Aa]uthorization"):
            await asyncio.wait_for(forged._connect(), 30)
        await forged.close()


def _context(ca: Path):
    import ssl

    return ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(ca))


@pytest.mark.timeout(300)
async def test_the_one_line_swap_trains_a_step_on_a_remote_stack_with_a_project_key(tmp_path):
    """The remote: a secure stack (per-project users) with the model's replica. The agent: only
    ``ServerlessBackend(api_key, base_url)``; its rollouts, its step, its served adapter."""
    remote = art.LocalBackend(path=tmp_path / "remote", secure=True, project=PROJECT)
    hosted = art.TrainableModel(name=MODEL, project=PROJECT, base_model=TINY)
    await hosted.register(remote)  # the operator's side: the stack and the model's replica
    await remote._inference_url(hosted)
    backend = art.ServerlessBackend(
        api_key=project_api_key(remote.stack.agent_env(PROJECT)), base_url=remote.stack.nats_url
    )
    model = art.TrainableModel(name=MODEL, project=PROJECT, base_model=TINY)
    try:
        await model.register(backend)
        groups = await art.gather_trajectory_groups(
            art.TrajectoryGroup(half_alphabet_rollout(model, max_tokens=8) for _ in range(4))
            for _ in range(2)
        )
        result = await model.train(groups, config=art.TrainConfig(learning_rate=1e-2))
        assert isinstance(result, art.ServerlessTrainResult)
        assert result.step == 1 and result.metrics["tokens_trained"] > 0
        assert result.artifact_name == f"{PROJECT}/{MODEL}:step1"
        completion = await model.openai_client().chat.completions.create(
            model=model.get_inference_name(1), messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert completion.model == f"{MODEL}@1"
    finally:
        await backend.close()
        await remote.close()
