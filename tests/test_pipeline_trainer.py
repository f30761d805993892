"""ART's PipelineTrainer on the real services: rollouts go on while the trainer trains, staleness
is bounded, measured and reported, inference is never paused, and a run resumes where it stopped."""

from __future__ import annotations

import asyncio
import itertools
import json

import pytest

import artery as art
from artery.pipeline_trainer import PipelineTrainer, PolicyCollapsed, make_group_rollout_fn
from artery.shared.models import TINY
from artery.testing.agents import half_alphabet_rollout

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


async def single(model: art.TrainableModel, scenario: int, config: dict) -> art.Trajectory:
    return await half_alphabet_rollout(model, max_tokens=config["max_tokens"])


async def test_pipeline_trains_off_policy_without_pausing_inference_and_resumes(tmp_path):
    backend = art.LocalBackend(path=tmp_path / "artery")
    model = art.TrainableModel(name="piped", project="async", base_model=TINY)
    try:
        await model.register(backend)
        trainer = PipelineTrainer(
            model,
            backend,
            make_group_rollout_fn(single, n=4),
            range(40),
            {"max_tokens": 6},
            num_rollout_workers=4,
            min_batch_size=2,
            max_batch_size=4,
            max_steps_off_policy=1,
            learning_rate=1e-2,
            max_steps=3,
        )
        await trainer.train()
        assert await model.get_step() == 3

        rows = [json.loads(line) for line in (model.directory / "history.jsonl").read_text().splitlines()]
        steps = [r for r in rows if "train/trained" in r]
        assert [r["step"] for r in steps] == [1, 2, 3]
        for row in steps:
            # Every step trained while inference kept serving, on samples at most 1 step old.
            assert row["train/replicas_paused"] == 0.0
            assert row["offpolicy/staleness_max"] <= 1.0
            assert row["offpolicy/trajectories_dropped"] >= 0.0
            assert "offpolicy/is_ratio_mean" in row or row["train/trained"] == 0.0
        assert any(r["offpolicy/staleness_max"] >= 1.0 for r in steps), "rollouts overlapped no step"
        state = json.loads((model.directory / "pipeline_state.json").read_text())
        assert state["training_step"] == 3 and state["scenario_offset"] >= 3 * 2

        # Resumed: the scenarios already used are skipped and training continues from step 3.
        used = state["scenario_offset"]
        seen: list[int] = []

        async def recording(model, scenario, config):
            seen.append(scenario)
            return await make_group_rollout_fn(single, n=4)(model, scenario, config)

        again = PipelineTrainer(
            model, backend, recording, range(40), {"max_tokens": 6}, min_batch_size=2, max_steps=1
        )
        await again.train()
        assert await model.get_step() == 4
        assert min(seen) >= used
    finally:
        await backend.close()


async def test_equal_reward_groups_in_a_row_stop_the_run_as_a_collapse(tmp_path):
    class NoBackend:  # never reached: every group is discarded first
        async def train(self, *args, **kwargs):
            raise AssertionError("nothing should be trained")

    class Model:
        async def get_step(self):
            return 0

        directory = tmp_path

    async def flat(model, scenario, config):
        return art.TrajectoryGroup([art.Trajectory(reward=1.0), art.Trajectory(reward=1.0)])

    trainer = PipelineTrainer(
        Model(), NoBackend(), flat, range(100), None, min_batch_size=2, discard_queue_multiplier=2
    )
    with pytest.raises(PolicyCollapsed, match="all-equal rewards"):
        await trainer.train()
    assert trainer.discarded_equal == 4


async def test_workers_faster_than_training_start_no_rollout_that_would_go_stale(tmp_path):
    """Eight workers whose rollouts take a millisecond feed steps that take 30: ART's gate alone
    (the policy's age) lets them fill the queue two steps deep, and half the groups reach the
    front too old to train on. Foreseeing the step that will take a group, none is wasted."""
    batch, off_policy, steps = 2, 1, 6
    ahead_seen: list[int] = []
    trained: list[list[int]] = []

    class Result:
        def __init__(self, step: int):
            self.step, self.metrics = step, {}

    class SlowBackend:
        async def train(self, model, groups, **kwargs):
            trained.append([int(g.metadata["policy_version"]) for g in groups])
            await asyncio.sleep(0.03)
            return Result(len(trained))

    class Model:
        directory = tmp_path

        async def get_step(self):
            return 0

        async def log(self, *args, **kwargs):
            pass

    async def fast(model, scenario, config):
        ahead_seen.append(trainer._ahead)
        await asyncio.sleep(0.001)
        return art.TrajectoryGroup([art.Trajectory(reward=0.0), art.Trajectory(reward=1.0)])

    trainer = PipelineTrainer(
        Model(),
        SlowBackend(),
        fast,
        itertools.count(),
        None,
        num_rollout_workers=8,
        min_batch_size=batch,
        max_batch_size=batch,
        max_steps_off_policy=off_policy,
        max_steps=steps,
        log_interval_seconds=3600,
    )
    await trainer.train()
    assert len(trained) == steps
    assert trainer.discarded_stale == 0
    for step, versions in enumerate(trained):
        assert all(step - v <= off_policy for v in versions), (step, versions)
    # Never more groups ahead than the batches that may still take them fresh, though 8 could run.
    assert max(ahead_seen) == (off_policy + 1) * batch


def test_arts_knobs_without_a_meaning_here_are_refused():
    with pytest.raises(ValueError, match="adam_params"):
        PipelineTrainer(None, None, None, [], None, adam_params={"lr": 1})
    with pytest.raises(ValueError, match="save_checkpoint"):
        PipelineTrainer(None, None, None, [], None, save_checkpoint=False)
