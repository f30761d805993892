"""``artery replay``: a fresh model trained on another model's stored groups, through the collector
and the trainer as the SDK's ``train()`` goes, ends up with the very same adapter at every step."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import asyncpg
import pytest
import torch
from safetensors.torch import load_file

import artery as art
from artery.ops.replay import replay_request_id
from artery.shared.models import TINY
from artery.testing.agents import half_alphabet_rollout

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
STEPS = 3


def adapter(backend: art.LocalBackend, model: str, step: int) -> dict[str, torch.Tensor]:
    path = backend.stack.home / "checkpoints" / "replay" / model / f"{step:06d}" / "adapter"
    return load_file(path / "adapter_model.safetensors")


def replay_cli(backend: art.LocalBackend, *args: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "ARTERY_NATS_URL": backend.stack.nats_url,
        "ARTERY_DATABASE_URL": backend.stack.database_url,
    }
    return subprocess.run(
        [sys.executable, "-m", "artery.ops.cli", "replay", "--project", "replay", "--model", "source", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


async def steps_of(database_url: str, model: str) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(database_url)
    try:
        return await conn.fetch(
            "SELECT step, request_id, group_ids, metrics FROM training_steps"
            " WHERE project = 'replay' AND model = $1 ORDER BY step",
            model,
        )
    finally:
        await conn.close()


async def test_a_replay_from_step_one_reproduces_every_adapter_bit_for_bit(tmp_path):
    backend = art.LocalBackend(path=tmp_path / "artery", services=("collector", "trainer", "publisher"))
    model = art.TrainableModel(name="source", project="replay", base_model=TINY)
    try:
        await model.register(backend)
        for _ in range(STEPS):
            groups = await art.gather_trajectory_groups(
                (
                    art.TrajectoryGroup(half_alphabet_rollout(model, max_tokens=8) for _ in range(6))
                    for _ in range(2)
                ),
                pbar_desc="rollouts",
            )
            await model.train(groups, config=art.TrainConfig(learning_rate=1e-2, loss_fn="grpo", epsilon=0.3))

        run = await asyncio.to_thread(replay_cli, backend, "--new-model", "again")
        assert run.returncode == 0, run.stderr
        assert f"replayed {STEPS} steps of replay/source as replay/again" in run.stdout

        source, again = (
            await steps_of(backend.database_url, "source"),
            await steps_of(backend.database_url, "again"),
        )
        assert [r["step"] for r in again] == list(range(1, STEPS + 1))
        for original, replayed in zip(source, again, strict=True):
            assert replayed["group_ids"] == original["group_ids"]
            assert replayed["request_id"] == replay_request_id("replay", "again", original["request_id"])
            o, r = (msgspec_decode(x["metrics"]) for x in (original, replayed))
            assert o["trained"] == r["trained"] == 1.0
            for key in ("loss", "grad_norm", "reward_mean", "tokens_trained", "ratio_mean", "learning_rate"):
                assert r[key] == o[key], key  # exactly: same inputs, same arithmetic
            original_weights, replayed_weights = (
                adapter(backend, "source", original["step"]),
                adapter(backend, "again", replayed["step"]),
            )
            assert original_weights.keys() == replayed_weights.keys()
            for name, tensor in original_weights.items():
                assert torch.equal(replayed_weights[name], tensor), (original["step"], name)

        # Running it again is a no-op: every step is answered from the trainer's record.
        rerun = await asyncio.to_thread(replay_cli, backend, "--new-model", "again")
        assert rerun.returncode == 0, rerun.stderr
        assert len(await steps_of(backend.database_url, "again")) == STEPS

        # A later range trains a fresh adapter on those steps' groups, with their configs.
        run = await asyncio.to_thread(replay_cli, backend, "--from-step", "2", "--new-model", "later")
        assert run.returncode == 0, run.stderr
        later = await steps_of(backend.database_url, "later")
        assert [r["group_ids"] for r in later] == [r["group_ids"] for r in source[1:]]
        first = msgspec_decode(later[0]["metrics"])
        assert first["reward_mean"] == msgspec_decode(source[1]["metrics"])["reward_mean"]
        later_weights, source_weights = adapter(backend, "later", 1), adapter(backend, "source", 2)
        # From the base model, not from the source's step 1.
        assert any(not torch.equal(later_weights[k], source_weights[k]) for k in source_weights)

        # Into a model that has trained on other steps: refused, with the reason.
        clash = await asyncio.to_thread(replay_cli, backend, "--from-step", "3", "--new-model", "again")
        assert clash.returncode != 0 and "steps of its own" in clash.stderr
    finally:
        await backend.close()


def msgspec_decode(value) -> dict:
    import json

    return json.loads(value) if isinstance(value, str | bytes) else dict(value)
