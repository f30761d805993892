"""``artery up`` / ``artery status`` / ``artery config`` as a user runs them."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ARTERY = [sys.executable, "-m", "artery.ops.cli"]


def read_until(proc: subprocess.Popen, pattern: str, timeout: float = 60.0) -> str:
    seen = ""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        seen += line
        if re.search(pattern, line):
            return seen
    raise AssertionError(f"{pattern!r} not printed; output so far:\n{seen}")


def test_up_status_restart_and_clean_shutdown(tmp_path: Path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ARTERY_")}
    home = tmp_path / "home"
    up = subprocess.Popen(
        [*ARTERY, "up", "--home", str(home)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        output = read_until(up, r"Artery is up")
        assert re.search(r"nats\s+ready\s+nats://127\.0\.0\.1:\d+ \(embedded\)", output)
        assert re.search(r"collector\s+started\s+pid (\d+)", output)
        # Where to connect, in one block, once ready.
        assert re.search(r"console\s+http://127\.0\.0\.1:\d+\n", output), output
        assert re.search(r"NATS\s+nats://127\.0\.0\.1:\d+\s+\(ARTERY_NATS_URL\)", output)
        assert re.search(r"credentials\s+none", output)

        status = subprocess.run(
            [*ARTERY, "status", "--home", str(home)], capture_output=True, text=True, env=env, timeout=60
        )
        assert status.returncode == 0, status.stderr
        assert f"(from {home.resolve() / 'stack.json'})" in status.stdout, status.stdout
        assert re.search(r"console\s+http://127\.0\.0\.1:\d+\n", status.stdout), status.stdout
        assert re.search(r"ARTERY_TRAJECTORIES\s+0\s+\d+\s+collector 0/0/0", status.stdout)
        assert re.search(r"trajectory_groups\s+0 rows", status.stdout)

        # A crashed service is restarted.
        pid = int(re.search(r"collector\s+started\s+pid (\d+)", output).group(1))
        os.kill(pid, signal.SIGKILL)
        read_until(up, r"collector\s+exited\s+code -9; restarting")
        read_until(up, r"collector\s+started\s+pid \d+")
        read_until(up, r"collector\s+ready")

        up.send_signal(signal.SIGINT)
        rest = up.communicate(timeout=60)[0]
        assert up.returncode == 0
        assert re.search(r"collector\s+stopped\s+code 0", rest)
        assert "servers      stopped" in rest
    finally:
        if up.poll() is None:  # a failed assertion: stop it the way a user would, children included
            up.send_signal(signal.SIGINT)
            try:
                up.wait(60)
            except subprocess.TimeoutExpired:
                up.kill()


def test_config_lists_every_setting_with_its_description():
    out = subprocess.run([*ARTERY, "config"], capture_output=True, text=True, check=True).stdout
    assert re.search(r"ARTERY_NATS_URL\s+'nats://127\.0\.0\.1:4222'\s+NATS server URL", out)
    assert re.search(r"ARTERY_COLLECTOR_BATCH_SIZE\s+500\s+messages fetched", out)


def test_invalid_settings_stop_a_service_at_start_with_a_clear_error(tmp_path):
    env = {**os.environ, "ARTERY_COLLECTOR_BATCH_SIZE": "lots", "ARTERY_DATABASE_URL": "postgresql://x"}
    result = subprocess.run(
        [sys.executable, "-m", "artery.services.collector"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert result.returncode == 2  # a bad setting, not a crash
    assert "ARTERY_COLLECTOR_BATCH_SIZE" in result.stderr and "Traceback" not in result.stderr


def test_a_service_still_waiting_for_nats_stops_on_sigterm():
    """A broker that never answers must not make a service unstoppable."""
    from artery.shared.embedded import free_port

    env = {
        **os.environ,
        "ARTERY_NATS_URL": f"nats://127.0.0.1:{free_port()}",  # nothing listens there
        "ARTERY_DATABASE_URL": "postgresql://nobody@127.0.0.1:1/none",
    }
    service = subprocess.Popen(
        [sys.executable, "-m", "artery.services.collector"],
        env={**env, "ARTERY_LOG_FORMAT": "json"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    # Its first failed connect attempt: started (SIGTERM handled from here on), and waiting for NATS.
    for line in service.stdout:
        if b'"event": "nats error"' in line:
            break
    else:
        raise AssertionError(f"the service exited with {service.wait()} before trying NATS")
    # What it logs from here on is drained, so a full pipe never blocks it.
    threading.Thread(target=service.stdout.read, daemon=True).start()
    started = time.monotonic()
    service.send_signal(signal.SIGTERM)
    assert service.wait(timeout=30) == 0
    assert time.monotonic() - started < 15


def test_nats_config_is_a_valid_server_config_with_a_secret_per_user(tmp_path):
    from artery.shared.embedded import nats_server_binary

    secrets = tmp_path / "secrets"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "artery.ops.cli",
            "nats-config",
            "--project",
            "demo",
            "--secrets-dir",
            str(secrets),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    config = tmp_path / "nats.conf"
    config.write_text(out)
    checked = subprocess.run([nats_server_binary(), "-t", "-c", str(config)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
    users = sorted(p.name for p in secrets.iterdir())
    assert users == sorted(
        ["admin", "agent-demo", "collector", "console", "inference", "publisher", "reward", "trainer"]
    ), users
    for name in users:
        password = (secrets / name).read_text().strip()
        assert (secrets / name).stat().st_mode & 0o077 == 0  # readable by its owner only
        assert f'user: "{name}", password: "$2a$' in out and password not in out  # hashed


def test_provision_creates_every_stream(nats_server):
    env = {**os.environ, "ARTERY_NATS_URL": nats_server.url}
    out = subprocess.run(
        [sys.executable, "-m", "artery.ops.cli", "provision"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and "provisioned" in out.stdout, out.stderr[-2000:]
    jsz = subprocess.run(
        [sys.executable, "-m", "artery.ops.cli", "status"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    for stream in (
        "ARTERY_TRAJECTORIES",
        "ARTERY_GROUPS",
        "ARTERY_TRAINING",
        "ARTERY_CHECKPOINTS",
        "ARTERY_DLQ",
    ):
        assert stream in jsz.stdout, jsz.stdout + jsz.stderr


def test_status_says_which_server_and_when_it_is_not_an_artery_stack(nats_server, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ARTERY_")}
    status = subprocess.run(
        [*ARTERY, "status", "--home", str(tmp_path)],
        env={**env, "ARTERY_NATS_URL": nats_server.url},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert status.returncode == 1
    assert f"NATS {nats_server.url} (from ARTERY_NATS_URL)" in status.stdout, status.stdout
    assert "not an Artery stack" in status.stdout, status.stdout


def test_replay_and_export_model_act_as_a_secure_stacks_admin(tmp_path, monkeypatch):
    """`artery up --secure` keeps the admin's password beside the stack: replay and export-model
    connect with it, as `artery status` does, unless ARTERY_NATS_USER says otherwise."""
    from artery.ops.cli import _nats_and_database
    from artery.shared.auth import nats_connect_options
    from artery.shared.settings import CommonSettings

    (tmp_path / "secrets").mkdir()
    (tmp_path / "secrets" / "admin").write_text("s3cret\n")
    (tmp_path / "stack.json").write_text(
        '{"nats_url": "nats://127.0.0.1:1", "database_url": "postgresql://x"}'
    )
    for name in ("ARTERY_NATS_URL", "ARTERY_DATABASE_URL", "ARTERY_NATS_USER", "ARTERY_NATS_PASSWORD_FILE"):
        monkeypatch.setenv(name, "")  # restored after the test, whatever the command sets
    assert _nats_and_database(str(tmp_path), "replay") == ("nats://127.0.0.1:1", "postgresql://x")
    options = nats_connect_options(CommonSettings())
    assert (options["user"], options["password"], options["inbox_prefix"]) == (
        "admin",
        "s3cret",
        "_INBOX.admin",
    )
    monkeypatch.setenv("ARTERY_NATS_USER", "ops")  # the caller's own credentials win
    monkeypatch.setenv("ARTERY_NATS_PASSWORD_FILE", str(tmp_path / "secrets" / "admin"))
    _nats_and_database(str(tmp_path), "replay")
    assert os.environ["ARTERY_NATS_USER"] == "ops"
