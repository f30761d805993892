"""The embedded stack with per-service NATS users (``Stack(secure=True)``, ``artery up --secure``):
every service runs under its own user, an agent under its project's, and what they may not do is
refused by the server."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import stat
import subprocess

import asyncpg
import httpx
import nats
import pytest

import artery as art
from artery.ops.stack import Stack
from artery.shared import bus, subjects
from artery.shared.auth import nats_connect_options
from artery.shared.models import TINY
from artery.shared.permissions import ROLES
from artery.shared.settings import CommonSettings
from artery.testing.agents import half_alphabet_rollout
from tests.factories import group
from tests.helpers import wait_for
from tests.test_cli import ARTERY, read_until
from tests.test_security import Client

PROJECT, OTHER, MODEL = "demo", "other", "agent"


async def connect(stack: Stack, environ: dict[str, str]) -> Client:
    errors: list[str] = []

    async def on_error(exc):
        errors.append(str(exc))

    settings = CommonSettings(nats_url=stack.nats_url)
    nc = await nats.connect(
        stack.nats_url, allow_reconnect=False, error_cb=on_error, **nats_connect_options(settings, environ)
    )
    return Client(nc, errors)


def violations(stack: Stack) -> list[str]:
    """Permission errors any service logged (``bus.connect`` logs the server's errors)."""
    return [
        f"{log.name}: {line}"
        for log in stack.logs.glob("*.log")
        for line in log.read_text(errors="replace").splitlines()
        if "permissions violation" in line.lower()
    ]


async def test_every_service_runs_as_its_own_user_and_an_agent_only_for_its_project(tmp_path):
    stack = Stack(home=tmp_path / "stack", secure=True, projects=(PROJECT,))
    await asyncio.to_thread(stack.start)
    clients: list[Client] = []
    try:
        for user in [r for r in ROLES if r != "agent"] + [f"agent-{PROJECT}"]:
            assert stat.S_IMODE((stack.secrets / user).stat().st_mode) == 0o600
        for name, process in stack.processes.items():
            user = name  # the console too: its own read-only user, not admin
            assert process.env["ARTERY_NATS_USER"] == user
            assert process.env["ARTERY_NATS_PASSWORD_FILE"] == str(stack.secrets / user)
        with pytest.raises(nats.errors.Error, match="Authorization Violation"):  # no credentials
            await nats.connect(stack.nats_url, allow_reconnect=False, max_reconnect_attempts=0)

        agent = await connect(stack, stack.agent_env(PROJECT))
        clients.append(agent)
        event = group(PROJECT, MODEL)
        await bus.publish_event(agent.js, subjects.trajectories(PROJECT, MODEL), event)
        conn = await asyncpg.connect(stack.database_url)
        try:

            async def stored():
                return await conn.fetchval("SELECT count(*) FROM trajectories WHERE group_id = $1", event.id)

            assert await wait_for(lambda: _equals(stored, len(event.trajectories))) is True
        finally:
            await conn.close()
        # The reward service consumed the collector's group.ready under its own user.
        admin = await connect(stack, {"ARTERY_NATS_USER": "admin", **_password(stack, "admin")})
        clients.append(admin)

        async def reward_consumed():
            info = await admin.js.consumer_info(subjects.GROUPS.name, subjects.REWARD_CONSUMER)
            return info.delivered.stream_seq >= 1 and info.num_pending == 0 and info.num_ack_pending == 0

        assert await wait_for(reward_consumed) is True
        agent.clean()
        admin.clean()

        other = subjects.trajectories(OTHER, MODEL)
        pause = subjects.control("pause", PROJECT, MODEL)
        await asyncio.gather(
            agent.denied(other, bus.publish_event(agent.js, other, group(OTHER, MODEL))),
            agent.denied(pause, agent.nc.publish(pause, b"{}")),
        )
        assert all(p.running for p in stack.processes.values())
        assert violations(stack) == []
    finally:
        for client in clients:
            with contextlib.suppress(Exception):
                await client.nc.close()
        await asyncio.to_thread(stack.stop)


def test_secure_needs_the_embedded_nats_and_projects_need_secure(tmp_path):
    with pytest.raises(ValueError, match="embedded NATS"):
        Stack(home=tmp_path, secure=True, nats_url="nats://127.0.0.1:4222")
    with pytest.raises(ValueError, match="secure"):
        Stack(home=tmp_path, projects=(PROJECT,))
    with pytest.raises(ValueError, match="project"):
        art.LocalBackend(path=tmp_path, secure=True)


@pytest.mark.timeout(300)
async def test_local_backend_secure_trains_a_step_end_to_end(tmp_path):
    """Agent → collector → trainer (pauses inference) → publisher → inference, each its own user."""
    backend = art.LocalBackend(path=tmp_path / "artery", secure=True, project=PROJECT)
    model = art.TrainableModel(name=MODEL, project=PROJECT, base_model=TINY)
    try:
        await model.register(backend)
        groups = await art.gather_trajectory_groups(
            art.TrajectoryGroup(half_alphabet_rollout(model, max_tokens=8) for _ in range(4))
            for _ in range(2)
        )
        result = await model.train(groups, config=art.TrainConfig(learning_rate=1e-2))
        assert result.step == 1 and await model.get_step() == 1
        assert backend.stack.processes[f"inference-{PROJECT}-{MODEL}"].env["ARTERY_NATS_USER"] == "inference"
        assert violations(backend.stack) == []
        # The rollouts carried the project's inference key; a request without it, or with
        # another, is refused.
        (replica,) = await backend.replicas(model)
        key_file = backend.stack.inference_key_file(PROJECT)
        assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
        async with httpx.AsyncClient(base_url=replica.url, timeout=30) as http:
            assert (await http.get("/v1/models")).status_code == 401
            wrong = {"Authorization": "Bearer another-projects-key"}
            assert (await http.get("/v1/models", headers=wrong)).status_code == 401
            right = {"Authorization": f"Bearer {key_file.read_text().strip()}"}
            served = (await http.get("/v1/models", headers=right)).json()["data"]
            assert f"{MODEL}@1" in [card["id"] for card in served]
    finally:
        await backend.close()


def test_artery_up_secure_prints_the_agent_credentials(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ARTERY_")}
    home = tmp_path / "home"
    up = subprocess.Popen(
        [*ARTERY, "up", "--home", str(home), "--secure", "--project", PROJECT, "--services", "collector"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        output = read_until(up, r"Artery is up")
        line = re.search(rf"agent-{PROJECT}\s+env\s+(.*)", output).group(1)
        agent_env = dict(re.findall(r"(ARTERY_\w+)=(\S+)", line))
        assert agent_env["ARTERY_NATS_USER"] == f"agent-{PROJECT}"
        key_file = agent_env["ARTERY_INFERENCE_API_KEY_FILE"]  # for its project's replicas
        assert stat.S_IMODE(os.stat(key_file).st_mode) == 0o600 and len(open(key_file).read().strip()) >= 32
        assert asyncio.run(_publish_as(agent_env)) == []

        secrets = home.resolve() / "secrets"
        admin = {**env, "ARTERY_NATS_USER": "admin", "ARTERY_NATS_PASSWORD_FILE": str(secrets / "admin")}
        # ``artery status`` connects as admin.
        status = subprocess.run(
            [*ARTERY, "status", "--home", str(home)], capture_output=True, text=True, env=admin, timeout=60
        )
        assert status.returncode == 0, status.stderr
        assert re.search(r"ARTERY_TRAJECTORIES\s+1\s+", status.stdout)
        # With no credentials given, it reads the stack's own admin secret beside stack.json.
        plain = subprocess.run(
            [*ARTERY, "status", "--home", str(home)], capture_output=True, text=True, env=env, timeout=60
        )
        assert plain.returncode == 0 and re.search(r"ARTERY_TRAJECTORIES\s+1\s+", plain.stdout), plain.stdout
        # Wrong credentials fail at once with the reason, instead of retrying forever.
        wrong = {**env, "ARTERY_NATS_USER": "admin", "ARTERY_NATS_PASSWORD": "not-the-password"}
        refused = subprocess.run(
            [*ARTERY, "status", "--home", str(home)], capture_output=True, text=True, env=wrong, timeout=60
        )
        assert refused.returncode == 1 and "cannot connect to NATS" in refused.stdout, refused.stdout

        up.send_signal(signal.SIGINT)
        up.communicate(timeout=60)
        assert up.returncode == 0
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
            try:
                up.wait(60)
            except subprocess.TimeoutExpired:
                up.kill()


async def _publish_as(environ: dict[str, str]) -> list[str]:
    """Publish one group with ``environ``'s credentials; the errors the server sent."""
    errors: list[str] = []

    async def on_error(exc):
        errors.append(str(exc))

    settings = CommonSettings(nats_url=environ["ARTERY_NATS_URL"])
    nc = await nats.connect(
        settings.nats_url, allow_reconnect=False, error_cb=on_error, **nats_connect_options(settings, environ)
    )
    ack = await bus.publish_event(
        nc.jetstream(), subjects.trajectories(PROJECT, MODEL), group(PROJECT, MODEL)
    )
    assert ack.stream == subjects.TRAJECTORIES.name
    await nc.close()
    return errors


def _password(stack: Stack, user: str) -> dict[str, str]:
    return {"ARTERY_NATS_PASSWORD_FILE": str(stack.secrets / user)}


async def _equals(fn, expected):
    return await fn() == expected
