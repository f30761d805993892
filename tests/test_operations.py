"""Operating a running secure stack: liveness and readiness of every service (HTTP and NATS), the
inference replica's metrics during real requests, the base model served by its own name, and the
console's actions (re-publish a dead letter after a fix, resume a stuck replica) with the admin
credential, refused without it.

One stack for the module (every service, one replica of the tiny model): starting it is most of
the cost. Tests run in file order; each leaves the stack as it found it (nothing paused).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal

import asyncpg
import httpx
import msgspec
import nats
import pytest

from artery.ops.stack import SERVICES, Stack
from artery.schemas import DeadLetter
from artery.shared import bus, subjects
from artery.shared.auth import nats_connect_options
from artery.shared.codec import CONTENT_TYPE, EventDecoder
from artery.shared.control_client import pause_replicas, registered_replicas, resume_replicas
from artery.shared.embedded import free_port
from artery.shared.models import TINY
from artery.shared.settings import CommonSettings
from tests.factories import group
from tests.helpers import wait_for
from tests.test_metrics import sample
from tests.test_secure_stack import violations

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
PROJECT, MODEL, REPLICA = "ops", "alpha", "r1"
REPLICA_PROCESS = f"inference-{PROJECT}-{MODEL}"
#: The collector's byte limit while the dead letter is made: well under the dead letters' own
#: payload limit (64 KiB), so the dead letter keeps the whole message and can be re-published.
SMALL_LIMIT = 16 * 1024


@pytest.fixture(scope="module")
def ops(tmp_path_factory):
    stack = Stack(
        home=tmp_path_factory.mktemp("ops") / "stack",
        secure=True,
        projects=(PROJECT,),
        extra_env={"ARTERY_COLLECTOR_MAX_GROUP_BYTES": str(SMALL_LIMIT)},
    )
    stack.start()
    try:
        env = {**stack.replica_env(PROJECT, MODEL, TINY), "ARTERY_INFERENCE_REPLICA_ID": REPLICA}
        stack.start_service(REPLICA_PROCESS, service="inference", env=env).wait_ready(timeout=240)
        yield stack
    finally:
        stack.stop()


async def connect_as(stack: Stack, user: str, errors: list[str] | None = None) -> nats.NATS:
    async def on_error(exc):
        if errors is not None:
            errors.append(str(exc))

    settings = CommonSettings(nats_url=stack.nats_url)
    environ = {"ARTERY_NATS_USER": user, "ARTERY_NATS_PASSWORD_FILE": str(stack.secrets / user)}
    return await nats.connect(
        stack.nats_url, allow_reconnect=False, error_cb=on_error, **nats_connect_options(settings, environ)
    )


def password(stack: Stack, user: str) -> str:
    return (stack.secrets / user).read_text().strip()


def metrics_url(stack: Stack, name: str) -> str:
    url = stack.processes[name].ready_info["metrics_url"]
    assert url.startswith("http://127.0.0.1:"), url
    return url


async def replica_info(stack: Stack):
    nc = await connect_as(stack, "admin")
    try:
        found = await registered_replicas(nc.jetstream(), subjects.replica_key(PROJECT, MODEL, REPLICA))
        return found[0] if found else None
    finally:
        await nc.close()


async def info_replies(nc: nats.NATS, service: str, window_s: float = 1.0) -> list[dict]:
    """Every ``$SRV.INFO`` answer for ``service``: gathered until ``window_s`` passes without one
    more (how many instances answer is what is asked, so no count to wait for is known)."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish(f"$SRV.INFO.{subjects.HEALTH_SERVICE.format(service=service)}", b"", reply=inbox)
    found = []
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=window_s)
            except nats.errors.TimeoutError:
                return found
            if msg.headers and msg.headers.get("Status") == "503":  # no responders
                return found
            found.append(json.loads(msg.data))
    finally:
        await sub.unsubscribe()


# -- health ----------------------------------------------------------------------------------------


async def test_every_service_is_live_and_ready_over_http_and_over_nats(ops):
    names = [*SERVICES, REPLICA_PROCESS]
    async with httpx.AsyncClient(timeout=10) as http:
        for name in names:
            base = metrics_url(ops, name).removesuffix("/metrics")
            assert (await http.get(f"{base}/healthz")).json() == {"status": "ok"}, name
            ready = await http.get(f"{base}/readyz")
            assert (ready.status_code, ready.json()) == (200, {"ready": True, "status": "ready"}), name
            assert "process_cpu_seconds_total" in (await http.get(f"{base}/metrics")).text
        # Inference and the console answer on their own port too.
        replica = ops.processes[REPLICA_PROCESS].ready_info["url"]
        assert (await http.get(f"{replica}/healthz")).status_code == 200
        ready = await http.get(f"{replica}/readyz")
        assert ready.status_code == 200 and ready.json() == {
            "ready": True,
            "status": "ready",
            "paused": False,
        }
        assert (await http.get(f"{ops.console_url}/healthz")).status_code == 200
        ready = await http.get(f"{ops.console_url}/readyz")
        assert ready.status_code == 200 and ready.json()["ready"] is True
        # The console reads as its own user: every page, with no permission refused.
        assert ops.processes["console"].env["ARTERY_NATS_USER"] == "console"
        for page in ("/", "/dead-letters", "/replicas", f"/models/{PROJECT}/{MODEL}", "/fragments/replicas"):
            assert (await http.get(ops.console_url + page)).status_code == 200, page

    admin = await connect_as(ops, "admin")
    try:
        for service, process in [*((s, s) for s in SERVICES), ("inference", REPLICA_PROCESS)]:
            name = subjects.HEALTH_SERVICE.format(service=service)
            info = json.loads((await admin.request(f"$SRV.INFO.{name}", b"", timeout=5)).data)
            assert info["name"] == name
            assert info["metadata"]["metrics_url"] == metrics_url(ops, process)
            assert info["metadata"]["pid"] == str(ops.processes[process].proc.pid)
            # One instance, by its id: what a health check of that instance asks.
            ping = json.loads((await admin.request(f"$SRV.PING.{name}.{info['id']}", b"", timeout=5)).data)
            assert ping["id"] == info["id"]
    finally:
        await admin.close()
    assert violations(ops) == []


async def test_a_service_is_live_but_not_ready_until_it_logs_ready(ops):
    """A second collector whose PostgreSQL is not there yet: live, not ready (HTTP 503, absent from
    NATS); once the database answers it logs ``ready`` and is ready everywhere."""
    pg_port = int(ops.database_url.rsplit(":", 1)[1].split("/")[0])
    port = free_port()
    env = {"ARTERY_DATABASE_URL": ops.database_url.replace(f":{pg_port}/", f":{port}/")}
    process = ops.start_service("collector-late", service="collector", env=env)
    forwarder = None
    admin = await connect_as(ops, "admin")
    try:

        async def waiting_line() -> dict | None:
            # Its metrics URL is on every line; "waiting for PostgreSQL" says where it is.
            for line in process.log_path.read_text().splitlines():
                if '"waiting for PostgreSQL"' in line:
                    return json.loads(line)
            return None

        base = (await wait_for(waiting_line, timeout=60))["metrics_url"].removesuffix("/metrics")
        async with httpx.AsyncClient(timeout=10) as http:
            assert (await http.get(f"{base}/healthz")).status_code == 200
            ready = await http.get(f"{base}/readyz")
            assert (ready.status_code, ready.json()) == (503, {"ready": False, "status": "starting"})
            pids = [r["metadata"]["pid"] for r in await info_replies(admin, "collector")]
            assert pids == [str(ops.processes["collector"].proc.pid)]  # the stack's, not this one

            async def pipe(reader, writer):
                with contextlib.suppress(Exception):
                    while data := await reader.read(65536):
                        writer.write(data)
                        await writer.drain()
                writer.close()

            async def forward(reader, writer):  # PostgreSQL "comes up" on the port it waits for
                upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", pg_port)
                await asyncio.gather(pipe(reader, upstream_writer), pipe(upstream_reader, writer))

            forwarder = await asyncio.start_server(forward, "127.0.0.1", port)
            await asyncio.to_thread(process.wait_ready, 60)
            ready = await http.get(f"{base}/readyz")
            assert (ready.status_code, ready.json()) == (200, {"ready": True, "status": "ready"})

            async def answers_on_nats() -> bool:
                # Registered on NATS by the runtime as the ready line is written: a moment later.
                replies = await info_replies(admin, "collector")
                return str(process.proc.pid) in {r["metadata"]["pid"] for r in replies}

            await wait_for(answers_on_nats, timeout=10)
    finally:
        await admin.close()
        # Killed, not stopped: it must not stay to take the stack's messages in later tests.
        process.signal(signal.SIGKILL)
        await asyncio.to_thread(process.proc.wait)
        ops.processes.pop("collector-late")
        if forwarder is not None:
            forwarder.close()


# -- inference -------------------------------------------------------------------------------------


async def test_replica_queue_depth_and_tokens_are_measured_during_requests(ops):
    replica = ops.processes[REPLICA_PROCESS].ready_info["url"]
    metrics = metrics_url(ops, REPLICA_PROCESS)
    key = ops.inference_key_file(PROJECT).read_text().strip()
    trainer = await connect_as(ops, "trainer")
    async with httpx.AsyncClient(timeout=60, headers={"Authorization": f"Bearer {key}"}) as http:

        async def scrape() -> str:
            return (await http.get(metrics)).text

        before = await scrape()
        assert sample(before, "artery_inference_queue_depth") == 0
        tokens_before = sample(before, "artery_inference_generated_tokens_total")
        # Paused, as for a training step: the request waits at the gate, held by the replica.
        paused = await pause_replicas(
            trainer, PROJECT, MODEL, lease_seconds=60, requested_by="test", timeout_s=10
        )
        body = {"model": MODEL, "messages": [{"role": "user", "content": "abc"}], "max_tokens": 24}
        request = asyncio.create_task(http.post(f"{replica}/v1/chat/completions", json=body))
        try:

            async def held() -> bool:
                return sample(await scrape(), "artery_inference_queue_depth") == 1

            await wait_for(held, timeout=30)
        finally:
            await resume_replicas(trainer, PROJECT, MODEL, paused.lease_id, requested_by="test")
        response = await request
        assert response.status_code == 200, response.text
        generated = response.json()["usage"]["completion_tokens"]
        assert generated > 0
        after = await scrape()
        assert sample(after, "artery_inference_queue_depth") == 0
        assert sample(after, "artery_inference_generated_tokens_total") - tokens_before == generated
        assert sample(after, "artery_inference_tokens_per_second") > 0

        # Streamed: held until its last chunk is read, counted token by token.
        body = {**body, "stream": True}
        async with http.stream("POST", f"{replica}/v1/chat/completions", json=body) as streamed:
            chunks = [line async for line in streamed.aiter_lines() if line.startswith("data: {")]
        assert chunks
        final = await scrape()
        assert sample(final, "artery_inference_queue_depth") == 0
        assert sample(final, "artery_inference_generated_tokens_total") > tokens_before + generated
    await trainer.close()


async def test_the_base_model_is_served_by_its_own_name(ops):
    replica = ops.processes[REPLICA_PROCESS].ready_info["url"]
    key = ops.inference_key_file(PROJECT).read_text().strip()
    async with httpx.AsyncClient(timeout=60, headers={"Authorization": f"Bearer {key}"}) as http:
        names = [m["id"] for m in (await http.get(f"{replica}/v1/models")).json()["data"]]
        assert names == [MODEL, f"{MODEL}@0", TINY]
        body = {"model": TINY, "messages": [{"role": "user", "content": "abc"}], "max_tokens": 4}
        response = await http.post(f"{replica}/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        assert response.json()["model"] == f"{MODEL}@0"  # the step-0 policy answered
        missing = await http.post(f"{replica}/v1/chat/completions", json={**body, "model": "gpt-4o"})
        assert missing.status_code == 404
        error = missing.json()["error"]
        assert error["code"] == "model_not_found"
        assert error["message"] == (
            f"The model `gpt-4o` does not exist; this replica serves `{MODEL}`, `{MODEL}@0`, "
            f"`{TINY}` (see /v1/models)"
        )


# -- console actions -------------------------------------------------------------------------------


async def dead_letters_of(nc: nats.NATS, kind: str) -> list[tuple[int, DeadLetter]]:
    js = nc.jetstream()
    info = await js.stream_info(subjects.DLQ.name)
    found = []
    for seq in range(max(info.state.first_seq, 1), info.state.last_seq + 1):  # 0: none yet
        msg = await js.get_msg(subjects.DLQ.name, seq)
        letter = EventDecoder(DeadLetter).decode(msg.data, (msg.headers or {}).get(CONTENT_TYPE))
        if letter.kind == kind:
            found.append((seq, letter))
    return found


async def test_console_republishes_a_dead_letter_with_the_admin_credential_only(ops):
    agent = await connect_as(ops, f"agent-{PROJECT}")
    admin = await connect_as(ops, "admin")
    db = await asyncpg.connect(ops.database_url)
    try:
        # Larger than the collector's limit: dead-lettered as too_large, the whole message kept.
        big = msgspec.structs.replace(group(PROJECT, MODEL, size=2), metadata={"padding": "x" * 24_000})
        await bus.publish_event(agent.jetstream(), subjects.trajectories(PROJECT, MODEL), big)

        async def too_large():
            return await dead_letters_of(admin, "too_large")

        [(seq, letter)] = await wait_for(too_large, timeout=30)
        assert letter.original_id.endswith(big.id) and not letter.payload_truncated
        assert f"more than the limit of {SMALL_LIMIT}" in letter.reason

        action = f"{ops.console_url}/actions/dead-letters/{seq}/republish"
        async with httpx.AsyncClient(timeout=30) as http:
            refused = await http.post(action)
            assert refused.status_code == 401 and refused.headers["www-authenticate"].startswith("Basic")
            wrong = await http.post(action, auth=("admin", "not-the-password"))
            assert wrong.status_code == 403 and "refused this user" in wrong.json()["detail"]
            # Another user's valid credential is not the admin's (the agent may publish its own
            # project's groups, but the console's actions are the operator's).
            agent_user = f"agent-{PROJECT}"
            denied = await http.post(action, auth=(agent_user, password(ops, agent_user)))
            assert denied.status_code == 403 and "only 'admin'" in denied.json()["detail"], denied.text

            # The fix: the collector takes larger groups now. Then the admin re-publishes.
            ops.processes["collector"].env["ARTERY_COLLECTOR_MAX_GROUP_BYTES"] = str(8 * 1024 * 1024)
            await asyncio.to_thread(ops.restart_service, "collector")
            await asyncio.to_thread(ops.processes["collector"].wait_ready, 60)
            done = await http.post(action, auth=("admin", password(ops, "admin")))
            assert done.status_code == 200, done.text
            assert done.json()["subject"] == subjects.trajectories(PROJECT, MODEL)

        async def stored():
            return await db.fetchval(
                "SELECT count(*) FROM trajectory_groups WHERE project = $1 AND id = $2", PROJECT, big.id
            )

        assert await wait_for(stored, timeout=30) == 1
        assert len(await dead_letters_of(admin, "too_large")) == 1  # no new dead letter
    finally:
        await db.close()
        await agent.close()
        await admin.close()


async def test_console_resumes_a_stuck_replica_with_the_admin_credential_only(ops):
    trainer = await connect_as(ops, "trainer")
    replica = ops.processes[REPLICA_PROCESS].ready_info["url"]
    try:
        # A trainer that pauses for ten minutes and dies: the replica is stuck until the lease ends.
        await pause_replicas(trainer, PROJECT, MODEL, lease_seconds=600, requested_by="test", timeout_s=10)
        await trainer.close()

        async def paused():
            info = await replica_info(ops)
            return info if info is not None and info.paused else None

        assert (await wait_for(paused, timeout=15)).lease_id
        action = f"{ops.console_url}/actions/replicas/{PROJECT}/{MODEL}/{REPLICA}/resume"
        async with httpx.AsyncClient(timeout=30) as http:
            assert (await http.post(action)).status_code == 401
            assert (await http.post(action, auth=("console", password(ops, "console")))).status_code == 403
            assert (await replica_info(ops)).paused
            # The page offers the action for the paused replica.
            page = (await http.get(f"{ops.console_url}/replicas")).text
            assert f'action="/actions/replicas/{PROJECT}/{MODEL}/{REPLICA}/resume"' in page

            done = await http.post(action, auth=("admin", password(ops, "admin")))
            assert done.status_code == 200, done.text
            assert done.json()["resumed"] is True and len(done.json()["released_leases"]) == 1
            health = (await http.get(f"{replica}/health")).json()
            assert health["status"] == "ok"

        async def serving():
            info = await replica_info(ops)
            return info is not None and not info.paused

        await wait_for(serving, timeout=15)
    finally:
        if not trainer.is_closed:
            await trainer.close()
