"""What `make kube-test` checks through the running pods: an agent on the host trains the tiny
model 2 steps; the trainer pod's container is SIGKILLed mid-step (once it asked the replicas to
pause for it) and the step is taken again when it comes back; PostgreSQL then holds every group once
and each step once; both inference replicas serve the new step; the NATS servers form one
cluster with every stream on all three."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
import urllib.request
from pathlib import Path

import httpx
import nats

import artery as art
from artery.shared import subjects
from artery.shared.permissions import inbox_prefix
from artery.testing.agents import half_alphabet_rollout
from loadtests.compose.scenario import (
    BASE_MODEL,
    GROUP_SIZE,
    GROUPS_PER_STEP,
    MODEL,
    PROJECT,
    RecordingBackend,
    check,
    check_nothing_lost,
)
from loadtests.kube.deployment import KubeDeployment, log

KILLED = "trainer-0"
REPLICAS = ("inference-0", "inference-1")


def agent_backend(deployment: KubeDeployment) -> RecordingBackend:
    """The SDK as an agent outside the cluster uses it: NATS as ``agent-demo`` with the password
    of its Secret, one replica's API (pod addresses: rootful podman routes them to the host)."""
    os.environ["ARTERY_NATS_USER"] = f"agent-{PROJECT}"
    os.environ["ARTERY_NATS_PASSWORD"] = deployment.nats_password(f"agent-{PROJECT}")
    os.environ.pop("ARTERY_OTEL_ENDPOINT", None)
    backend = RecordingBackend(nats_url=deployment.nats_url, inference_url=deployment.inference_url)
    backend.published = {}
    return backend


async def groups_for(model: art.TrainableModel) -> list:
    return await asyncio.gather(
        *(
            art.TrajectoryGroup(half_alphabet_rollout(model) for _ in range(GROUP_SIZE))
            for _ in range(GROUPS_PER_STEP)
        )
    )


async def kill_mid_step(deployment: KubeDeployment, groups: list, model, config, kill: dict):
    """Step 2 with the trainer SIGKILLed once it asks the replicas to pause for it: the step has
    begun. The operator's ``admin`` user reads every subject, the trainer's pause request too."""
    nc = await nats.connect(
        deployment.nats_url,
        user="admin",
        password=deployment.nats_password("admin"),
        inbox_prefix=inbox_prefix("admin"),
        allow_reconnect=False,
    )
    try:
        # Looked up before: `podman inspect` may take longer than a tiny model's step.
        info = await asyncio.to_thread(deployment.container, deployment.plan(KILLED))
        pid, restarts = info["State"]["Pid"], info.get("RestartCount", 0)
        pauses = await nc.subscribe(subjects.control("pause", PROJECT, MODEL))
        train = asyncio.create_task(model.train(groups, config=config, timeout_s=900))
        next_pause = asyncio.ensure_future(pauses.next_msg(timeout=900))
        await asyncio.wait({train, next_pause}, return_when=asyncio.FIRST_COMPLETED)
        if next_pause.done() and not train.done():
            os.kill(pid, signal.SIGKILL)  # as the kernel's OOM killer would
            kill.update(pid=pid, restarts=restarts, at=time.monotonic())
            log(f"  SIGKILL {KILLED}'s container (pid {pid} on the host) mid-step: it asked for a pause")
        else:
            next_pause.cancel()
        return await train
    finally:
        await nc.close()


def resumed_steps(logs: str) -> list[int]:
    """Steps the trainer's last process (after its last ``starting`` line) resumed models from."""
    last_start = logs.rfind('"event": "starting"')
    steps = []
    for candidate in re.findall(r"\{[^{}]*\}", logs[max(last_start, 0) :]):
        try:
            line = json.loads(candidate)
        except ValueError:  # a warning's text, not a log line
            continue
        if line.get("event") == "resuming":
            steps.append(line["step"])
    return steps


async def training_with_a_kill(deployment: KubeDeployment, base_path: Path, results: dict) -> None:
    backend = agent_backend(deployment)
    try:
        model = art.TrainableModel(
            name=MODEL, project=PROJECT, base_model=BASE_MODEL, base_path=str(base_path)
        )
        await model.register(backend)
        config = art.TrainConfig(learning_rate=5e-3)
        started = time.monotonic()
        first = await model.train(await groups_for(model), config=config, timeout_s=900)
        log(f"  step {first.step} trained")
        results["step_1_s"] = round(time.monotonic() - started, 1)

        kill: dict = {}
        second_started = time.monotonic()
        second = await kill_mid_step(deployment, await groups_for(model), model, config, kill)
        results["step_2_with_kill_s"] = round(time.monotonic() - second_started, 1)
        results["train_2_steps_s"] = round(time.monotonic() - started, 1)
        log(f"  step {second.step} trained")
        check(bool(kill), "the trainer was killed mid-step (after its pause request for step 2)")
        check([first.step, second.step] == [1, 2], f"the agent trained steps {first.step}, {second.step}")
        results["killed"] = {
            "pod": KILLED,
            "step_done_after_kill_s": round(time.monotonic() - kill["at"], 1),
        }

        info = await asyncio.to_thread(deployment.wait_restarted, KILLED, kill["restarts"])
        restarts = info.get("RestartCount", 0)
        check(
            info["State"]["Pid"] != kill["pid"] and restarts > kill["restarts"],
            f"{KILLED}'s container came back (restartPolicy; restarts {kill['restarts']} -> {restarts})",
        )
        results["killed"]["restart_count"] = restarts
        resumed = resumed_steps(deployment.logs(KILLED, 400))
        check(resumed == [1], f"the restarted trainer resumed the model from step 1's checkpoint ({resumed})")
        await check_nothing_lost(deployment, backend, expected_steps=[1, 2])
        for replica in REPLICAS:
            url = f"http://{deployment.ip(replica)}:8000/v1/models"
            async with httpx.AsyncClient(timeout=30) as client:
                names = {m["id"] for m in (await client.get(url)).json()["data"]}
            check(f"{MODEL}@2" in names, f"{replica} serves {MODEL}@2")
    finally:
        await backend.close()


def nats_is_one_cluster(deployment: KubeDeployment, results: dict) -> None:
    """Each server routes to the other two, and the streams are replicated on all three."""
    for index in range(3):
        base = f"http://{deployment.ip(f'nats-{index}')}:8222"
        with urllib.request.urlopen(f"{base}/routez", timeout=10) as response:
            routes = {r.get("remote_name") for r in json.loads(response.read())["routes"]}
        check(len(routes - {None}) == 2, f"nats-{index} routes to the other two servers ({sorted(routes)})")
    with urllib.request.urlopen(f"{base}/jsz?accounts=true&streams=true&config=true", timeout=10) as response:
        jsz = json.loads(response.read())
    streams = [
        stream for account in jsz.get("account_details", []) for stream in account.get("stream_detail", [])
    ]
    replicas = {s["name"]: s["config"].get("num_replicas") for s in streams}
    results["streams"] = replicas
    check(
        bool(replicas) and set(replicas.values()) == {3},
        f"every stream and bucket has 3 replicas ({len(replicas)} streams)",
    )
