"""Credentials at rest: the nats-server configuration Artery writes (``Stack(secure=True)`` and
``artery nats-config``) holds bcrypt hashes of the users' passwords, never the passwords, and
every file that holds either is readable by its owner only."""

from __future__ import annotations

import asyncio
import os
import re
import stat
from pathlib import Path

import bcrypt
import nats
import pytest

from artery.ops.cli import main
from artery.ops.stack import Stack
from artery.shared.auth import nats_connect_options
from artery.shared.embedded import NatsServer, write_private
from artery.shared.permissions import BCRYPT_COST
from artery.shared.settings import CommonSettings

PROJECT = "demo"
USERS = {"admin", "console", "collector", "reward", "trainer", "publisher", "inference", f"agent-{PROJECT}"}
RENDERED_USER = re.compile(r'\{ user: "([^"]+)", password: "([^"]+)"')


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def assert_hashes_only(config: str, passwords: dict[str, str]) -> None:
    """``config`` names every user with a bcrypt hash of its password and holds no password."""
    hashes = dict(RENDERED_USER.findall(config))
    assert hashes.keys() == passwords.keys()
    for user, password in passwords.items():
        assert password not in config, user
        assert hashes[user].startswith(f"$2a${BCRYPT_COST:02d}$"), hashes[user]
        assert bcrypt.checkpw(password.encode(), hashes[user].encode()), user


async def connect(url: str, user: str, password: str) -> None:
    """Connect as ``user`` with ``password`` the way services do, and close again."""
    options = nats_connect_options(
        CommonSettings(nats_url=url), {"ARTERY_NATS_USER": user, "ARTERY_NATS_PASSWORD": password}
    )
    nc = await nats.connect(url, allow_reconnect=False, max_reconnect_attempts=0, **options)
    await nc.flush()
    await nc.close()


async def assert_server_checks_passwords(url: str, user: str, password: str) -> None:
    await connect(url, user, password)
    with pytest.raises(Exception, match=r"[Aa]uthorization"):
        await connect(url, user, password + "x")


async def test_secure_stack_writes_hashes_only_and_private_files(tmp_path):
    # NATS only: a database URL given means no PostgreSQL is started (none is needed here).
    stack = Stack(home=tmp_path / "stack", secure=True, projects=(PROJECT,), database_url="postgresql://-")
    await asyncio.to_thread(stack.start_infrastructure)  # provisions as admin: its password works
    try:
        passwords = {p.name: p.read_text().strip() for p in stack.secrets.iterdir()}
        assert passwords.keys() == USERS
        assert all(mode(stack.secrets / user) == 0o600 for user in USERS)
        config = stack.home / "nats" / "nats-server.conf"
        assert mode(config) == 0o600
        assert_hashes_only(config.read_text(), passwords)
        # nats-server warns of plaintext passwords in its configuration; it has none to warn of.
        assert "Plaintext passwords" not in (stack.logs / "nats-server.log").read_text()
        await assert_server_checks_passwords(
            stack.nats_url, f"agent-{PROJECT}", passwords[f"agent-{PROJECT}"]
        )
    finally:
        stack.stop()


async def test_nats_config_writes_hashes_only_and_private_files(tmp_path, capsys):
    secrets, output = tmp_path / "secrets", tmp_path / "users.conf"
    assert (
        main(["nats-config", "--project", PROJECT, "--secrets-dir", str(secrets), "--output", str(output)])
        == 0
    )
    passwords = {p.name: p.read_text().strip() for p in secrets.iterdir()}
    assert passwords.keys() == USERS
    assert mode(secrets) == 0o700
    assert all(mode(secrets / user) == 0o600 for user in USERS)
    assert mode(output) == 0o600
    assert_hashes_only(output.read_text(), passwords)

    # Printed instead (run again: the passwords are kept), it reveals no password either.
    assert main(["nats-config", "--project", PROJECT, "--secrets-dir", str(secrets)]) == 0
    assert_hashes_only(capsys.readouterr().out, passwords)

    with NatsServer(tmp_path / "nats", extra_config=output.read_text()) as server:
        await assert_server_checks_passwords(server.url, "collector", passwords["collector"])


def test_private_files_get_their_mode_on_creation_whatever_the_umask(tmp_path):
    path = tmp_path / "users.conf"
    path.write_text("old")
    path.chmod(0o644)
    leftover = tmp_path / ".users.conf.tmp"  # an interrupted write's, readable by all
    leftover.write_text("")
    leftover.chmod(0o666)
    previous = os.umask(0)  # with no umask to narrow it, only the mode given on creation counts
    try:
        write_private(path, "new")
    finally:
        os.umask(previous)
    assert (path.read_text(), mode(path)) == ("new", 0o600)
    assert not leftover.exists()
