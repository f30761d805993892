"""What `make compose-test` checks through the running containers: an agent on the host trains
the tiny model, a SIGKILLed service comes back by its restart policy with nothing lost or trained
twice, the data outlives ``down``/``up``, each NATS user is held to its role, and one trace
crosses the agent and the service containers."""

from __future__ import annotations

import asyncio
import os
import time
from collections import defaultdict
from pathlib import Path

import asyncpg
import httpx
import nats
import nats.errors

import artery as art
from artery.shared import subjects
from artery.shared.permissions import inbox_prefix, permissions, stream_names
from artery.shared.tracing import SDK_SERVICE
from artery.testing.agents import half_alphabet_rollout
from loadtests.compose.deployment import Deployment
from loadtests.compose.podman import log

PROJECT, MODEL, BASE_MODEL = "demo", "agent", "artery/tiny-random"
GROUPS_PER_STEP, GROUP_SIZE = 2, 4
#: The service killed with SIGKILL while the agent publishes a step's groups.
KILLED = "collector"
#: Compose services whose spans count towards the trace (service.name of each).
SERVICE_NAMES = {"collector", "reward", "trainer", "publisher", "inference"}


class Failed(AssertionError):
    pass


def check(condition: bool, message: str) -> None:
    if not condition:
        raise Failed(message)
    log(f"  ok: {message}")


class RecordingBackend(art.Backend):
    """``art.Backend`` that keeps the id and size of every group it publishes."""

    published: dict[str, int]

    async def publish(self, model, groups, *, split: str = "train") -> list[str]:
        groups = list(groups)
        ids = await super().publish(model, groups, split=split)
        for group_id, group in zip(ids, groups, strict=True):
            self.published[group_id] = len(group.trajectories)
        return ids


def agent_backend(deployment: Deployment) -> RecordingBackend:
    """The SDK as an agent on the host uses it: NATS's published port as ``agent-demo``, the
    published inference port, spans to the published OTLP port."""
    os.environ["ARTERY_NATS_USER"] = f"agent-{PROJECT}"
    os.environ["ARTERY_NATS_PASSWORD"] = deployment.nats_password(f"agent-{PROJECT}")
    os.environ["ARTERY_OTEL_ENDPOINT"] = f"http://127.0.0.1:{deployment.ports['OTLP_HTTP_PORT']}"
    backend = RecordingBackend(nats_url=deployment.nats_url, inference_url=deployment.inference_url)
    backend.published = {}
    return backend


async def train_steps(
    backend: RecordingBackend, model: art.TrainableModel, steps: int, before_train=None
) -> list[int]:
    done = []
    for _ in range(steps):
        groups = await asyncio.gather(
            *(
                art.TrajectoryGroup(half_alphabet_rollout(model) for _ in range(GROUP_SIZE))
                for _ in range(GROUPS_PER_STEP)
            )
        )
        if before_train is not None:
            await before_train(len(done) + 1)
        result = await model.train(groups, config=art.TrainConfig(learning_rate=5e-3), timeout_s=900)
        log(f"  step {result.step} trained ({sum(len(g.trajectories) for g in groups)} trajectories)")
        done.append(result.step)
    return done


async def served_names(deployment: Deployment) -> set[str]:
    async with httpx.AsyncClient(timeout=30) as client:
        response = await client.get(f"{deployment.inference_url}/models")
        response.raise_for_status()
        return {m["id"] for m in response.json()["data"]}


async def chat(deployment: Deployment, name: str) -> str:
    async with httpx.AsyncClient(timeout=60) as client:
        response = await client.post(
            f"{deployment.inference_url}/chat/completions",
            json={"model": name, "messages": [{"role": "user", "content": "a b c"}], "max_tokens": 4},
        )
        response.raise_for_status()
        return response.json()["model"]


async def stored(deployment: Deployment) -> dict:
    """What PostgreSQL holds of the model: groups with their trajectory counts, steps, checkpoints."""
    conn = await asyncpg.connect(deployment.database_url)
    try:
        groups = {
            r["id"]: (r["num_trajectories"], r["rows"])
            for r in await conn.fetch(
                "SELECT g.id, g.num_trajectories, count(t.idx) AS rows FROM trajectory_groups g"
                " LEFT JOIN trajectories t ON t.group_id = g.id WHERE g.project = $1 AND g.model = $2"
                " GROUP BY g.id, g.num_trajectories",
                PROJECT,
                MODEL,
            )
        }
        steps = [
            r["step"]
            for r in await conn.fetch(
                "SELECT step FROM training_steps WHERE project = $1 AND model = $2 ORDER BY step",
                PROJECT,
                MODEL,
            )
        ]
        checkpoints = [
            r["step"]
            for r in await conn.fetch(
                "SELECT step FROM checkpoints WHERE project = $1 AND model = $2 ORDER BY step", PROJECT, MODEL
            )
        ]
    finally:
        await conn.close()
    return {"groups": groups, "steps": steps, "checkpoints": checkpoints}


async def training_with_a_kill(deployment: Deployment, base_path: Path, results: dict) -> RecordingBackend:
    """2 steps from the host; the collector SIGKILLed just before the second step's groups are
    published (they wait in JetStream until its restarted container stores them)."""
    backend = agent_backend(deployment)
    model = art.TrainableModel(name=MODEL, project=PROJECT, base_model=BASE_MODEL, base_path=str(base_path))
    await model.register(backend)
    kill: dict = {}

    async def kill_before_second_step(step: int) -> None:
        if step == 2:
            pid, restarts = await asyncio.to_thread(deployment.kill, KILLED)
            kill.update(pid=pid, restarts=restarts, at=time.monotonic())
            log(f"  SIGKILL {KILLED} (pid {pid} on the host), then step 2's groups are published")

    started = time.monotonic()
    steps = await train_steps(backend, model, 2, kill_before_second_step)
    results["train_2_steps_s"] = round(time.monotonic() - started, 1)
    check(steps == [1, 2], f"the agent trained steps {steps} through the containers")
    names = await served_names(deployment)
    check(f"{MODEL}@2" in names, f"the inference container serves {MODEL}@2 (/v1/models: {sorted(names)})")
    check(
        await chat(deployment, f"{MODEL}@2") == f"{MODEL}@2",
        f"a chat completion on {MODEL}@2 is answered by it",
    )

    info = deployment.container(KILLED)
    restarts = info.get("RestartCount", 0)
    check(
        info["State"]["Status"] == "running"
        and restarts > kill["restarts"]
        and info["State"]["Pid"] != kill["pid"],
        f"{KILLED} came back by its restart policy (restarts {kill['restarts']} -> {restarts})",
    )
    results["killed"] = {"service": KILLED, "restart_count": restarts}
    await check_nothing_lost(deployment, backend, expected_steps=[1, 2])
    return backend


async def check_nothing_lost(
    deployment: Deployment, backend: RecordingBackend, expected_steps: list[int]
) -> dict:
    data = await stored(deployment)
    published = backend.published
    check(
        {g: (n, n) for g, n in published.items()} == data["groups"],
        f"PostgreSQL holds every group published ({len(published)}), each trajectory once"
        f" ({sum(published.values())} trajectories)",
    )
    check(data["steps"] == expected_steps, f"training_steps holds steps {data['steps']}, none twice")
    check(data["checkpoints"] == expected_steps, f"checkpoints of steps {data['checkpoints']} recorded")
    return data


async def survives_down_and_up(deployment: Deployment, backend: RecordingBackend, results: dict) -> None:
    before = await stored(deployment)
    await backend.close()
    started = time.monotonic()
    await asyncio.to_thread(deployment.down)
    log("  down (volumes kept); up again")
    await asyncio.to_thread(deployment.up)
    healthy = await asyncio.to_thread(deployment.wait_healthy)
    results["up_again_healthy_s"] = round(time.monotonic() - started, 1)
    results["time_to_healthy_again"] = {k: round(v, 1) for k, v in healthy.items()}
    after = await stored(deployment)
    check(after == before, "after down/up PostgreSQL holds the same groups, steps and checkpoints")
    fresh = agent_backend(deployment)
    try:
        model = art.TrainableModel(name=MODEL, project=PROJECT, base_model=BASE_MODEL)
        await model.register(fresh)  # keeps the registered step
        check(await model.get_step() == 2, "the model registry (JetStream on its volume) still says step 2")
    finally:
        await fresh.close()
    names = await served_names(deployment)
    check(f"{MODEL}@2" in names, f"the new inference container serves {MODEL}@2 from the object store")


# --- NATS users -------------------------------------------------------------------------------

ADAPTER_CHUNK = f"$O.{subjects.ADAPTERS_BUCKET}.C.compose-test-probe"
#: What a user might try beyond its role: (what, publish or subscribe, subject). Each is tried
#: by every user whose permissions (``shared.permissions``, what ``nats-users`` generated) do not
#: allow it, and the server must refuse it. Allowed ones are not sent: they would be real events.
PROBES = [
    ("pause inference", "pub", subjects.control("pause", PROJECT, MODEL)),
    ("write an adapter chunk", "pub", ADAPTER_CHUNK),
    ("announce a group stored", "pub", subjects.group_ready(PROJECT, MODEL)),
    ("announce a checkpoint published", "pub", subjects.checkpoint("published", PROJECT, MODEL)),
    ("publish another project's trajectories", "pub", subjects.trajectories("other", MODEL)),
    ("publish trajectories", "pub", subjects.trajectories(PROJECT, MODEL)),
    ("read every subject", "sub", ">"),
]
USERS = {
    "admin": ("admin", None),
    f"agent-{PROJECT}": ("agent", PROJECT),
    **{r: (r, None) for r in ("collector", "reward", "trainer", "publisher", "inference")},
}


def allowed(user: str, kind: str, subject: str) -> bool:
    role, project = USERS[user]
    rules = permissions(role, user, project=project)
    if kind == "sub":
        return any(subjects.covers(p, subject) for p in rules.subscribe)
    return any(subjects.covers(p, subject) for p in rules.publish) and not any(
        subjects.covers(p, subject) for p in rules.deny_publish
    )


async def refused(nc: nats.NATS, errors: list, kind: str, subject: str) -> bool:
    errors.clear()
    if kind == "pub":
        await nc.publish(subject, b"{}")
    else:
        await nc.subscribe(subject)
    await nc.flush()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # the server's -ERR comes asynchronously, after the flush
        if any(
            "permissions violation" in str(e).lower() and subject.lower() in str(e).lower() for e in errors
        ):
            return True
        await asyncio.sleep(0.05)
    return False


async def users_hold_to_their_roles(deployment: Deployment) -> None:
    with_wrong_password = False
    try:
        await nats.connect(
            deployment.nats_url, user="collector", password="wrong", allow_reconnect=False, connect_timeout=5
        )
    except (nats.errors.Error, OSError) as exc:
        with_wrong_password = "authorization" in str(exc).lower()
    check(with_wrong_password, "NATS refuses a service user with a wrong password")
    for user in USERS:
        errors: list = []

        async def on_error(exc, errors=errors):
            errors.append(exc)

        nc = await nats.connect(
            deployment.nats_url,
            user=user,
            password=deployment.nats_password(user),
            error_cb=on_error,
            allow_reconnect=False,
            inbox_prefix=inbox_prefix(user),
        )
        try:
            # The one JetStream call every role may make (agents hold no STREAM.INFO since #27).
            assert subjects.TRAJECTORIES.name in await stream_names(nc.jetstream())
            probes = [
                (what, kind, subject) for what, kind, subject in PROBES if not allowed(user, kind, subject)
            ]
            assert probes, f"{user}: every probe is allowed by its permissions; nothing to check"
            failures = [
                what for what, kind, subject in probes if not await refused(nc, errors, kind, subject)
            ]
            names = ", ".join(what for what, _, _ in probes)
            check(
                not failures, f"{user}: in with its own password; refused {names} (not refused: {failures})"
            )
        finally:
            await nc.close()
    # Each service's own connection, as the server sees it: which user it authenticated as.
    async with httpx.AsyncClient(timeout=10) as client:
        connz = (
            await client.get(
                f"http://127.0.0.1:{deployment.ports['NATS_MONITOR_PORT']}/connz?auth=1&limit=1000"
            )
        ).json()
    users_by_name = defaultdict(set)
    for c in connz.get("connections") or []:
        users_by_name[c.get("name")].add(c.get("authorized_user"))
    for service in ("collector", "reward", "trainer", "publisher", "inference"):
        check(
            users_by_name.get(f"artery-{service}") == {service},
            f"the {service} container is connected as NATS user {service}",
        )


# --- traces -------------------------------------------------------------------------------------


async def one_trace_crosses_the_containers(deployment: Deployment, results: dict) -> None:
    from opentelemetry import trace

    provider = trace.get_tracer_provider()
    if hasattr(provider, "force_flush"):
        provider.force_flush()  # the agent's own spans
    best: tuple[int, str, set[str]] = (0, "", set())
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the services export in batches (every 5 s by default)
        async with httpx.AsyncClient(timeout=30) as client:
            spans = (await client.get(deployment.spans_url)).json()
        services = defaultdict(set)
        for span in spans:
            services[span["trace_id"]].add(span["service"])
        for trace_id, names in services.items():
            if SDK_SERVICE in names and len(names & SERVICE_NAMES) > best[0]:
                best = (len(names & SERVICE_NAMES), trace_id, names)
        if best[0] >= 4:
            break
        await asyncio.sleep(1.0)
    results["trace"] = {"trace_id": best[1], "services": sorted(best[2]), "spans_recorded": len(spans)}
    check(
        best[0] >= 4,
        f"one trace ({best[1]}) crosses the agent and {best[0]} service containers: {sorted(best[2])}",
    )
