"""The SDK's OpenAI client follows the live replicas in the registry (``artery.routing``).

Real NATS (the registry), real HTTP servers as replicas (OpenAI-compatible, scripted), the
SDK's own client: requests are spread over the replicas, a dead one is skipped without the
agent seeing an error, a new one is used once registered, and a name only some replicas serve
(``agent@2``) goes to those.
"""

from __future__ import annotations

import contextlib

import msgspec
import pytest

import artery as art
from artery import routing
from artery.schemas import ReplicaInfo
from artery.shared import bus, subjects
from artery.shared.embedded import free_port
from artery.shared.settings import CommonSettings
from artery.testing.judge import serve_scripted_judge

PROJECT, MODEL = "routing", "agent"


async def register_replica(js, replica_id: str, url: str, served: list[str]) -> None:
    """What an inference replica's heartbeat writes."""
    kv = await js.key_value(subjects.REPLICAS_BUCKET)
    info = ReplicaInfo(
        replica_id=replica_id, project=PROJECT, model=MODEL, engine="fake", url=url, served=served
    )
    await kv.put(subjects.replica_key(PROJECT, MODEL, replica_id), msgspec.json.encode(info))


async def ask(client, model: str = MODEL) -> str:
    response = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])
    return response.choices[0].message.content


@pytest.fixture
async def registry(nats_server):
    nc = await bus.connect(CommonSettings(nats_url=nats_server.url), name="test-registry")
    await bus.provision(nc.jetstream(), CommonSettings(nats_url=nats_server.url))
    yield nc.jetstream()
    await nc.close()


@pytest.fixture(autouse=True)
def read_the_registry_on_every_request(monkeypatch):
    monkeypatch.setattr(routing, "REFRESH_S", 0.0)
    monkeypatch.delenv("ARTERY_INFERENCE_URL", raising=False)


async def test_requests_follow_the_live_replicas(nats_server, registry):
    with contextlib.ExitStack() as servers:
        a, b, c = (servers.enter_context(serve_scripted_judge()) for _ in range(3))
        for name, server in zip("abc", (a, b, c), strict=True):
            server.answers = [name]
        await register_replica(registry, "a", a.url, [MODEL, f"{MODEL}@1"])
        await register_replica(registry, "b", b.url, [MODEL, f"{MODEL}@1", f"{MODEL}@2"])

        async with art.Backend(nats_url=nats_server.url) as backend:
            model = art.TrainableModel(name=MODEL, project=PROJECT, base_model="tiny")
            await model.register(backend)
            client = model.openai_client()

            # Round robin over both replicas.
            answers = [await ask(client) for _ in range(6)]
            assert sorted(answers) == ["a"] * 3 + ["b"] * 3

            # A step only b has loaded goes to b only.
            assert {await ask(client, f"{MODEL}@2") for _ in range(4)} == {"b"}

            # a moves to where nothing listens (or dies before its heartbeat expires): nobody sees
            # an error, b answers.
            a_requests = len(a.requests)
            await register_replica(registry, "a", f"http://127.0.0.1:{free_port()}", [MODEL])
            assert {await ask(client) for _ in range(4)} == {"b"}
            assert len(a.requests) == a_requests

            # A replica registered later is used.
            await register_replica(registry, "c", c.url, [MODEL])
            assert "c" in {await ask(client) for _ in range(6)}


async def test_no_live_replica_is_a_connection_error_that_names_the_model(nats_server, registry):
    import openai

    with serve_scripted_judge() as server:
        server.answers = ["x"]
        await register_replica(registry, "only", server.url, [MODEL])
        async with art.Backend(nats_url=nats_server.url) as backend:
            model = art.TrainableModel(name=MODEL, project=PROJECT, base_model="tiny")
            await model.register(backend)
            client = model.openai_client().with_options(max_retries=0)
            assert await ask(client) == "x"
            kv = await registry.key_value(subjects.REPLICAS_BUCKET)
            await kv.delete(subjects.replica_key(PROJECT, MODEL, "only"))
            with pytest.raises(openai.APIConnectionError) as caught:
                await ask(client)
            assert "no live replica serves agent" in repr(caught.value.__cause__)


async def test_a_burst_of_requests_reads_the_registry_once():
    """A group's rollouts all start at once: one registry read serves them all."""
    import asyncio

    import httpx

    reads = 0

    async def replicas() -> list[ReplicaInfo]:
        nonlocal reads
        reads += 1
        await asyncio.sleep(0.05)  # a round trip to NATS
        return [ReplicaInfo(replica_id="r", project=PROJECT, model=MODEL, engine="fake", url="http://r:1")]

    seen: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(str(request.url))
        return httpx.Response(200, json={})

    router = routing.ReplicaRouter(httpx.MockTransport(answer), replicas, base_path="/v1", refresh_s=60)
    async with httpx.AsyncClient(transport=router, base_url="http://placeholder/v1") as client:
        await asyncio.gather(*(client.post("/chat/completions", json={"model": MODEL}) for _ in range(32)))
    assert reads == 1
    assert seen == ["http://r:1/v1/chat/completions"] * 32
