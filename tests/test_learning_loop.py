"""The loop closes: rollouts → collector → trainer → publisher → inference, all real processes."""

from __future__ import annotations

import asyncio
import signal
import statistics

import pytest

import artery as art
from artery.shared.control_client import live_replicas
from artery.shared.models import TINY
from artery.testing.agents import half_alphabet_rollout
from artery.testing.tasks import half_alphabet_task_prompt

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]
GROUPS_PER_STEP, GROUP_SIZE, MAX_TOKENS = 2, 8, 8


def rollout(model: art.TrainableModel):
    return half_alphabet_rollout(model, max_tokens=MAX_TOKENS)


async def gather(model: art.TrainableModel) -> list[art.TrajectoryGroup]:
    return await art.gather_trajectory_groups(
        (
            art.TrajectoryGroup(
                half_alphabet_rollout(model, max_tokens=MAX_TOKENS) for _ in range(GROUP_SIZE)
            )
            for _ in range(GROUPS_PER_STEP)
        ),
        pbar_desc="rollouts",
    )


def mean_reward(groups: list[art.TrajectoryGroup]) -> float:
    return statistics.fmean(t.reward for g in groups for t in g)


async def test_mean_reward_rises_to_0_8_within_60_steps(tmp_path):
    backend = art.LocalBackend(path=tmp_path / "artery")
    model = art.TrainableModel(name="alpha", project="e2e", base_model=TINY)
    try:
        await model.register(backend)
        curve: list[float] = []
        steps = 0
        for _ in range(60):
            groups = await gather(model)
            curve.append(mean_reward(groups))
            if len(curve) >= 3 and statistics.fmean(curve[-3:]) >= 0.8:
                break
            result = await model.train(groups, config=art.TrainConfig(learning_rate=1e-2, loss_fn="cispo"))
            steps += 1
            assert result.step == steps
        print("reward curve:", [round(r, 2) for r in curve])
        assert statistics.fmean(curve[:3]) < 0.5, "the task must start hard"
        assert statistics.fmean(curve[-3:]) >= 0.8, curve
        assert await model.get_step() == steps
        # Retention on demand: the latest step is kept, and the publisher had already been
        # pruning (keep latest + best by reward_mean) after every step.
        applied = await model.delete_checkpoints("reward_mean")
        assert steps in applied.kept and len(applied.kept) <= 2
    finally:
        await backend.close()


async def test_a_trainer_killed_mid_step_resumes_and_inference_is_not_left_paused(tmp_path):
    backend = art.LocalBackend(path=tmp_path / "artery")
    # A short pause lease and ack wait, so the test sees expiry and redelivery in seconds.
    backend.stack.extra_env.update({"ARTERY_TRAINER_PAUSE_LEASE_S": "4", "ARTERY_TRAINER_ACK_WAIT_S": "6"})
    model = art.TrainableModel(name="alpha", project="crash", base_model=TINY)
    try:
        await model.register(backend)
        first = await model.train(await gather(model), config=art.TrainConfig(learning_rate=1e-2))
        assert first.step == 1
        js = await backend._js()

        async def paused_everywhere():
            replicas = await live_replicas(js, model.project, model.name)
            return replicas and all(r.paused for r in replicas)

        second = asyncio.create_task(
            model.train(await gather(model), config=art.TrainConfig(learning_rate=1e-2))
        )
        for _ in range(600):
            if await paused_everywhere():
                break
            await asyncio.sleep(0.01)
        backend.stack.processes["trainer"].signal(signal.SIGKILL)  # mid-step: paused, not yet saved
        await asyncio.to_thread(backend.stack.processes["trainer"].proc.wait)

        # The lease runs out: inference answers again although nobody resumed it.
        response = await asyncio.wait_for(
            model.openai_client().chat.completions.create(
                model=model.name, messages=half_alphabet_task_prompt(), max_tokens=4
            ),
            timeout=30,
        )
        assert response.choices

        backend.stack.start_service("trainer")
        result = await asyncio.wait_for(second, timeout=300)
        assert result.step == 2  # resumed from step 1, the request trained once
        assert await model.get_step() == 2
        replicas = await live_replicas(js, model.project, model.name)
        assert replicas and not any(r.paused for r in replicas)
    finally:
        await backend.close()
