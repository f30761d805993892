"""The SDK against real services: LocalBackend (embedded stack) and Backend (join by URL)."""

from __future__ import annotations

import asyncio
import json

import asyncpg

import artery as art
from artery.demos.examples_support import TINY
from tests.helpers import wait_for


async def rollout(i: int) -> art.Trajectory:
    await asyncio.sleep(0)
    return art.Trajectory(
        messages_and_choices=[
            {"role": "user", "content": f"say {i}"},
            {
                "message": {"role": "assistant", "content": str(i)},
                "finish_reason": "stop",
                "logprobs": {"content": [{"token": "token_id:42", "logprob": -0.3, "top_logprobs": []}]},
            },
        ],
        reward=i / 4,
    )


async def test_local_backend_starts_the_stack_and_stores_published_groups(tmp_path):
    backend = art.LocalBackend(path=tmp_path / "artery", start_inference=False)
    model = art.TrainableModel(name="agent", project="sdk", base_model=TINY)
    try:
        await model.register(backend)
        assert await model.get_step() == 0
        groups = await art.gather_trajectory_groups(
            art.TrajectoryGroup(rollout(i) for i in range(4)) for _ in range(3)
        )
        ids = await model.publish(groups)
        conn = await asyncpg.connect(backend.database_url)

        async def stored():
            return await conn.fetchval("SELECT count(*) FROM trajectories WHERE group_id = ANY($1)", ids)

        assert await wait_for(lambda: _equals(stored, 12)) is True
        body = json.loads(
            await conn.fetchval("SELECT body::text FROM trajectories WHERE group_id = $1 AND idx = 1", ids[0])
        )
        assert body["messages"][1]["sample"] == {
            "token_ids": [42],
            "logprobs": [-0.3],
            "finish_reason": "stop",
        }
        assert await conn.fetchval("SELECT step FROM trajectory_groups WHERE id = $1", ids[0]) == 0
        await conn.close()
    finally:
        await backend.close()
    assert not backend.stack.processes["collector"].running


async def _equals(fn, expected):
    return await fn() == expected


async def test_backend_by_url_registers_logs_and_publishes(nats_server, db, run_collector, tmp_path):
    await run_collector()
    async with art.Backend(nats_url=nats_server.url) as backend:
        model = art.TrainableModel(
            name="agent", project="sdk", base_model="tiny", base_path=str(tmp_path), config={"lr": 1}
        )
        await model.register(backend)
        await model.register(backend)  # idempotent; keeps the step
        assert await model.get_step() == 0
        group = await art.TrajectoryGroup(rollout(i) for i in range(4))
        metrics = await model.log([group], split="val")
        assert metrics["val/reward"] == 0.375 and metrics["val/exception_rate"] == 0.0
        history = (tmp_path / "sdk" / "models" / "agent" / "history.jsonl").read_text().splitlines()
        assert json.loads(history[-1])["val/reward"] == 0.375 and json.loads(history[-1])["step"] == 0

        async def stored():
            return await db.fetchval("SELECT count(*) FROM trajectory_groups WHERE split = 'val'") == 1

        await wait_for(stored)


async def test_unregistered_model_says_what_to_do():
    model = art.Model(name="m", project="p")
    try:
        await model.publish(art.TrajectoryGroup([art.Trajectory(reward=1.0)]))
    except RuntimeError as exc:
        assert "register" in str(exc)
    else:
        raise AssertionError("publishing without a backend must fail")


async def test_local_backend_serves_the_model_and_choices_keep_their_tokens(tmp_path, monkeypatch):
    import litellm

    from artery.shared.models import TINY

    backend = art.LocalBackend(path=tmp_path / "artery")
    model = art.TrainableModel(name="agent", project="sdk", base_model=TINY)
    try:
        await model.register(backend)
        client = model.openai_client()
        assert model.openai_client() is client  # cached, as in ART
        response = await client.chat.completions.create(
            model=model.get_inference_name(),
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=6,
            logprobs=True,
            top_logprobs=2,
        )
        choice = response.choices[0]
        trajectory = art.Trajectory(
            messages_and_choices=[{"role": "user", "content": "hello"}, choice], reward=1
        )
        sample = trajectory.to_wire().messages[1].sample
        assert sample.token_ids == choice.model_extra["token_ids"]
        assert sample.logprobs == [entry.logprob for entry in choice.logprobs.content]
        assert sample.top_logprobs[0][0].token_id is not None

        params = model.litellm_completion_params()
        assert params["model"] == "hosted_vllm/agent" and params["temperature"] == 1
        reply = await litellm.acompletion(
            **params, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert reply.choices[0].message.content is not None
    finally:
        await backend.close()
