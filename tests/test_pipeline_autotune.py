"""``PipelineRuntimeConfig`` / ``PipelineAutotuneConfig`` on Artery's ``PipelineTrainer``: the
autotune rule as a pure function, and a real run on the tiny model where it adds rollout workers
to an underfed trainer and every metric it logs is one ``art.PIPELINE_RL_METRIC_DEFINITIONS`` defines."""

from __future__ import annotations

import json
import logging

import pytest

import artery as art
from artery.metrics import metric_definition
from artery.pipeline_config import AutotuneWindow, next_rollout_workers
from artery.pipeline_trainer import PipelineTrainer, make_group_rollout_fn
from artery.pipeline_trainer.step_meter import freshness_discount
from artery.shared.models import TINY
from artery.testing.agents import half_alphabet_rollout
from artery.utils import art_settings

TUNE = art.PipelineAutotuneConfig(mode="online", window_steps=1, warmup_ignore_steps=0)


def window(*, wait: float = 0.0, taken: int = 10, stale: int = 0, blocked: float = 0.0) -> AutotuneWindow:
    return AutotuneWindow(
        wall_s=10.0, trainer_wait_s=wait, groups_taken=taken, groups_stale=stale, put_wait_frac=blocked
    )


def test_an_underfed_trainer_gets_more_workers_within_the_bounds():
    decision = next_rollout_workers(4, window(wait=5.0), TUNE)
    assert (decision.action, decision.workers) == ("increase", 6)  # worker_step 2 > 10% of 4
    assert next_rollout_workers(100, window(wait=5.0), TUNE).workers == 110  # 10% of 100
    assert next_rollout_workers(400, window(wait=5.0), TUNE).workers == 416  # max_worker_move
    capped = art.PipelineAutotuneConfig(mode="online", max_rollout_workers=5)
    assert next_rollout_workers(4, window(wait=5.0), capped).workers == 5
    assert next_rollout_workers(5, window(wait=5.0), capped).action == "hold"


def test_stale_groups_take_workers_away_and_block_any_increase():
    decision = next_rollout_workers(8, window(wait=5.0, stale=3), TUNE)
    assert (decision.action, decision.workers) == ("decrease", 6)
    # Between the clearing and the high level: no more workers, none taken away either.
    assert next_rollout_workers(8, window(wait=5.0, stale=2), TUNE).action == "hold"  # 0.2: not above
    assert next_rollout_workers(8, window(wait=5.0, stale=1), TUNE).action == "increase"  # 0.1: cleared
    assert next_rollout_workers(1, window(stale=9), TUNE).workers == 1  # never below one


def test_blocked_workers_are_more_than_the_trainer_takes():
    # The trainer waits, but the workers wait on the staleness bound: adding workers cannot help.
    decision = next_rollout_workers(8, window(wait=5.0, blocked=0.5), TUNE)
    assert (decision.action, decision.workers) == ("decrease", 6)
    assert next_rollout_workers(8, window(wait=0.1, blocked=0.1), TUNE).action == "hold"


def test_freshness_discount_is_arts_rollout_weighted():
    assert freshness_discount([]) == 1.0
    assert freshness_discount([(0, 4)]) == 1.0
    # 1 / mean(exp(age / 8)) over 2 fresh rollouts and 2 sampled 8 steps ago.
    assert freshness_discount([(0, 2), (8, 2)]) == pytest.approx(2 / (1 + 2.718281828459045))


def test_configs_validate_as_arts_do(monkeypatch, caplog):
    with pytest.raises(ValueError, match="max_batch_size"):
        art.PipelineRuntimeConfig(min_batch_size=4, max_batch_size=2)
    with pytest.raises(ValueError, match="num_rollout_workers"):
        art.PipelineRuntimeConfig(num_rollout_workers=0)
    with pytest.raises(ValueError, match="keeps no tuning profiles"):
        art.PipelineAutotuneConfig(mode="profile")
    with pytest.raises(ValueError, match="stale_clear_frac"):
        art.PipelineAutotuneConfig(stale_clear_frac=0.5, stale_high_frac=0.2)
    # ART's settings for what Artery's rule does not tune are taken (and said to do nothing).
    monkeypatch.setattr(art_settings, "_noted", set())  # each note is once per process
    with caplog.at_level(logging.WARNING):
        art.PipelineAutotuneConfig(mode="online")
        assert "no effect" not in caplog.text  # ART's defaults say nothing
        config = art.PipelineAutotuneConfig(mode="online", packing_trials=64, window_steps=2)
    assert (config.mode, config.window_steps, config.packing_trials) == ("online", 2, 64)
    assert "PipelineAutotuneConfig(packing_trials) has no effect" in caplog.text


def test_the_trainer_takes_its_sizes_from_one_place():
    trainer = PipelineTrainer(
        None,
        None,
        None,
        [],
        None,
        pipeline=art.PipelineRuntimeConfig(num_rollout_workers=3, min_batch_size=2),
    )
    assert (trainer.num_rollout_workers, trainer.min_batch_size, trainer.max_batch_size) == (3, 2, 20)
    with pytest.raises(ValueError, match="cannot be combined"):
        PipelineTrainer(None, None, None, [], None, pipeline=art.PipelineRuntimeConfig(), autotune=TUNE)
    with pytest.raises(ValueError, match="cannot be combined"):
        PipelineTrainer(None, None, None, [], None, pipeline=art.PipelineRuntimeConfig(), min_batch_size=2)


#: Defined metrics a short run without them does not log: a KL penalty, sequences dropped, eval.
CONDITIONAL = {"train/kl_mean", "dropped/*", "val/reward", "val/reward_std_dev", "val/exception_rate"}


async def single(model: art.TrainableModel, scenario: int, config: dict) -> art.Trajectory:
    return await half_alphabet_rollout(model, max_tokens=config["max_tokens"])


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_online_autotune_feeds_the_trainer_and_every_logged_metric_is_defined(tmp_path):
    backend = art.LocalBackend(path=tmp_path / "artery", gpu_cost_per_hour_usd=2.0)
    model = art.TrainableModel(name="tuned", project="autotune", base_model=TINY)
    try:
        await model.register(backend)
        trainer = PipelineTrainer(
            model,
            backend,
            make_group_rollout_fn(single, n=4),
            range(40),
            {"max_tokens": 6},
            num_rollout_workers=1,  # one worker cannot keep a trainer that wants 2 groups fed
            min_batch_size=2,
            max_batch_size=2,
            max_steps_off_policy=2,
            learning_rate=1e-2,
            max_steps=3,
            # Whether the trainer waited more than the default 8% of the first window, or the
            # worker was blocked on a full queue, depends on how fast this machine trains against
            # how fast it samples (the rule's thresholds are tested above, on fixed windows).
            # Here any wait counts and blocking never does, so the first window certainly asks
            # for more workers: the trainer waits for its first groups before its first step.
            autotune=art.PipelineAutotuneConfig(
                mode="online",
                window_steps=1,
                warmup_ignore_steps=0,
                trainer_load_under_score=0.0,
                queue_put_severe_frac=2.0,
            ),
        )
        await trainer.train()
        assert await model.get_step() == 3
        first = trainer.autotune_decisions[0]
        assert first[:3] == (1, 3, "increase"), trainer.autotune_decisions

        rows = [json.loads(line) for line in (model.directory / "history.jsonl").read_text().splitlines()]
        steps = [r for r in rows if "train/trained" in r]
        workers = [r["pipeline_trainer/num_rollout_workers"] for r in steps]
        assert workers[0] == 1.0 and workers[1] == 3.0, workers
        for row in steps:
            assert row["throughput/accepted_train_tok_per_s"] > 0.0
            assert 0.0 < row["sample_efficiency/freshness_discount"] <= 1.0
            assert row["objective/score"] == pytest.approx(
                row["throughput/accepted_train_tok_per_s"] * row["sample_efficiency/freshness_discount"]
            )
            assert row["costs/gpu"] == pytest.approx(row["pipeline_trainer/step_wall_s"] * 2.0 / 3600)

        logged = {k for r in rows for k in r} - {"step", "recorded_at"}
        undefined = sorted(k for k in logged if metric_definition(k) is None)
        assert not undefined, f"logged but not in PIPELINE_RL_METRIC_DEFINITIONS: {undefined}"
        defined = {d.key for d in art.PIPELINE_RL_METRIC_DEFINITIONS} - CONDITIONAL
        families = {k for k in defined if k.endswith("*")}
        never = sorted(defined - families - logged)
        assert not never, f"defined but never logged: {never}"
        for family in families:
            assert any(
                metric_definition(k) is not None and metric_definition(k).key == family for k in logged
            )
    finally:
        await backend.close()
