"""Artery's pipeline-RL metrics in ART's taxonomy (``art.MetricDefinition``, ``art.PIPELINE_RL_*``).

Each definition is a key as it lands in ``history.jsonl`` (and W&B) when a ``PipelineTrainer``
runs on Artery: what the ``PipelineTrainer`` measures itself (``objective/``, ``throughput/``,
``queue/``, ``costs/``, ``pipeline_trainer/``), what the trainer service reports for each step
(``offpolicy/`` as it is, the rest under ``train/`` through ``model.log``), and what ``model.log``
summarises of the groups (``train/reward``...). A key ending in ``*`` names a family (the
staleness histogram's buckets, the reasons a sequence was dropped). Metrics a rollout puts in
``Trajectory.metrics`` are the program's own and are not described here.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Literal

import msgspec

MetricKind = Literal["counter", "duration", "gauge", "rate", "ratio", "score"]
_KINDS = ("counter", "duration", "gauge", "rate", "ratio", "score")


class MetricDefinition(msgspec.Struct, kw_only=True, frozen=True):
    """What one metric key means (ART's fields)."""

    key: str
    title: str
    description: str
    kind: MetricKind
    unit: str | None = None
    higher_is_better: bool | None = None
    dashboard_default: bool = False
    score_component: bool = False

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"MetricDefinition.kind must be one of {_KINDS}, not {self.kind!r}")
        if "/" not in self.key:
            raise ValueError(f"a metric key names its section ('section/name'), not {self.key!r}")


def _define(
    key: str,
    title: str,
    kind: MetricKind,
    description: str,
    unit: str | None = None,
    better: bool | None = None,
    *,
    dashboard: bool = False,
    score: bool = False,
) -> MetricDefinition:
    return MetricDefinition(
        key=key,
        title=title,
        description=description,
        kind=kind,
        unit=unit,
        higher_is_better=better,
        dashboard_default=dashboard,
        score_component=score,
    )


_OBJECTIVE = (
    _define(
        "objective/score",
        "Score",
        "score",
        "accepted train tokens per second times the freshness discount",
        None,
        True,
        dashboard=True,
        score=True,
    ),
    _define(
        "sample_efficiency/freshness_discount",
        "Freshness discount",
        "ratio",
        "1 / rollout-weighted mean(exp(policy age in train steps / 8)) of the accepted groups",
        None,
        True,
        score=True,
    ),
    _define(
        "throughput/accepted_train_tok_per_s",
        "Accepted train tokens per second",
        "rate",
        "tokens the trainer trained on divided by the PipelineTrainer's step wall time",
        "tok/s",
        True,
        dashboard=True,
        score=True,
    ),
    _define(
        "offpolicy/rollout_weighted_policy_age_steps",
        "Policy age",
        "gauge",
        "mean train-step age of"
        " the policy that sampled each accepted rollout (Artery weighs rollouts, not tokens)",
        "steps",
        False,
        score=True,
    ),
    _define(
        "pipeline_trainer/step_collect_batch_s",
        "Collect-batch time",
        "duration",
        "time the training stage waited for enough accepted groups for a step",
        "s",
        False,
        dashboard=True,
    ),
    _define(
        "pipeline_trainer/step_wall_s",
        "Step wall time",
        "duration",
        "time from the end of the previous step to the end of this one",
        "s",
        False,
    ),
    _define(
        "pipeline_trainer/num_rollout_workers",
        "Rollout workers",
        "gauge",
        "rollout workers the PipelineTrainer runs (autotune changes it)",
        "workers",
        None,
        dashboard=True,
    ),
    _define(
        "queue/depth", "Queue depth", "gauge", "groups waiting for the trainer when the step began", "groups"
    ),
    _define(
        "queue/actual_stale_fraction",
        "Stale fraction",
        "ratio",
        "groups taken from the queue for this step that were too old to train on",
        None,
        False,
        dashboard=True,
    ),
    _define(
        "queue/put_wait_frac",
        "Queue put wait",
        "ratio",
        "share of the rollout workers' time spent waiting for room in the queue or for a fresh enough policy",
        None,
        False,
    ),
    _define(
        "costs/gpu",
        "GPU cost",
        "counter",
        "step wall time priced at LocalBackend's gpu_cost_per_hour_usd (only when it is set)",
        "USD",
        False,
    ),
)

_PIPELINE = (
    _define(
        "offpolicy/discarded_stale_groups",
        "Stale groups discarded",
        "counter",
        "groups dropped"
        " since the run began because their policy was more than max_steps_off_policy steps old",
        "groups",
        False,
    ),
    _define(
        "data/discarded_equal_reward_groups",
        "Equal-reward groups discarded",
        "counter",
        "groups dropped since the run began because all their rewards were equal",
        "groups",
        False,
    ),
    _define(
        "data/step_num_groups", "Groups in the step", "gauge", "groups handed to this train step", "groups"
    ),
)

_OFFPOLICY = (
    _define(
        "offpolicy/trajectories_dropped",
        "Stale trajectories dropped",
        "counter",
        "trajectories the trainer dropped as too far off policy",
        "trajectories",
        False,
    ),
    _define(
        "offpolicy/dropped_fraction",
        "Dropped fraction",
        "ratio",
        "share of trajectories the trainer dropped as too far off policy",
        None,
        False,
    ),
    _define(
        "offpolicy/staleness_unknown",
        "Unknown staleness",
        "counter",
        "trajectories whose sampling step the trainer could not tell",
        "trajectories",
    ),
    _define(
        "offpolicy/staleness_mean",
        "Mean staleness",
        "gauge",
        "mean steps between the policy that sampled a trained trajectory and the step trained",
        "steps",
        False,
        dashboard=True,
    ),
    _define(
        "offpolicy/staleness_max",
        "Max staleness",
        "gauge",
        "the oldest trained trajectory's staleness",
        "steps",
        False,
    ),
    _define(
        "offpolicy/staleness_*",
        "Staleness histogram",
        "counter",
        "trained trajectories by staleness bucket (0, 1, 2, 3+ steps)",
        "trajectories",
    ),
    _define(
        "offpolicy/is_ratio_mean",
        "Importance ratio mean",
        "ratio",
        "mean truncated importance-sampling weight on trained tokens (off-policy steps)",
    ),
    _define(
        "offpolicy/is_truncated_fraction",
        "Truncated IS fraction",
        "ratio",
        "share of trained tokens whose importance weight hit the cap",
        None,
        False,
    ),
)


def _train(
    name: str,
    title: str,
    kind: MetricKind,
    description: str,
    unit: str | None = None,
    better: bool | None = None,
    *,
    dashboard: bool = False,
) -> MetricDefinition:
    return _define(f"train/{name}", title, kind, description, unit, better, dashboard=dashboard)


_TRAINER = (
    _train(
        "reward",
        "Reward",
        "gauge",
        "mean reward of the step's groups (model.log)",
        None,
        True,
        dashboard=True,
    ),
    _train("reward_std_dev", "Reward std", "gauge", "mean within-group reward std (model.log)"),
    _train(
        "exception_rate", "Exception rate", "ratio", "share of rollouts that raised (model.log)", None, False
    ),
    _train("reward_mean", "Trained reward", "gauge", "mean reward the trainer saw", None, True),
    _train("reward_std", "Trained reward std", "gauge", "mean within-group reward std the trainer saw"),
    _train("loss", "Loss", "gauge", "mean policy loss over the step's updates", None, None, dashboard=True),
    _train("grad_norm", "Gradient norm", "gauge", "mean gradient norm before clipping"),
    _train("ratio_mean", "Policy ratio mean", "ratio", "mean new/old probability ratio on trained tokens"),
    _train(
        "clip_fraction",
        "Clipped fraction",
        "ratio",
        "share of trained tokens whose ratio was clipped",
        None,
        False,
    ),
    _train("kl_mean", "KL", "gauge", "mean KL to the reference (kl_penalty_coef > 0)"),
    _train("learning_rate", "Learning rate", "gauge", "learning rate of the step"),
    _train("optimizer_steps", "Optimizer steps", "counter", "optimizer updates the step applied"),
    _train(
        "tokens_trained",
        "Tokens trained",
        "counter",
        "assistant tokens that carried a gradient",
        "tokens",
        dashboard=True,
    ),
    _train("trained", "Trained", "gauge", "1 when the step changed the adapter, else 0"),
    _train(
        "autocast_bf16",
        "bf16 passes",
        "gauge",
        "1 when the step's forward and backward ran in bf16 autocast (ARTERY_TRAINER_AUTOCAST), else 0",
    ),
    _train("groups", "Groups", "counter", "groups the trainer received", "groups"),
    _train("groups_trained", "Groups trained", "counter", "groups with a trained sequence", "groups"),
    _train(
        "groups_skipped_equal_rewards",
        "Equal-reward groups",
        "counter",
        "groups skipped: all rewards equal",
        "groups",
        False,
    ),
    _train(
        "groups_skipped_too_small",
        "Too-small groups",
        "counter",
        "groups skipped: fewer than two rollouts",
        "groups",
        False,
    ),
    _train("trajectories", "Trajectories", "counter", "trajectories the trainer received"),
    _train("trajectories_used", "Trajectories used", "counter", "trajectories that became sequences"),
    _train("sequences", "Sequences", "counter", "training sequences built"),
    _train("sequences_cut", "Sequences cut", "counter", "sequences cut to the max length", None, False),
    _train("sequences_split", "Sequences split", "counter", "trajectories split into several sequences"),
    _train(
        "sequences_dropped",
        "Sequences dropped",
        "counter",
        "sequences dropped for a reason other than a zero advantage",
        None,
        False,
    ),
    _define(
        "dropped/*",
        "Dropped by reason",
        "counter",
        "sequences dropped, by reason (artery.backend_api.DROP_REASONS)",
    ),
    _train("step_time_s", "Step compute time", "duration", "trainer compute time of the step", "s", False),
    _train(
        "step_total_s", "Step total time", "duration", "trainer time from request to saved step", "s", False
    ),
    _train("pause_s", "Pause time", "duration", "time replicas were paused for the step", "s", False),
    _train("save_s", "Save time", "duration", "time to save the step's checkpoint", "s", False),
    _train("replicas_paused", "Replicas paused", "gauge", "replicas paused for the step (0 off policy)"),
)

_EVAL = (
    _define(
        "val/reward", "Eval reward", "gauge", "mean reward of eval_fn's groups", None, True, dashboard=True
    ),
    _define("val/reward_std_dev", "Eval reward std", "gauge", "mean within-group reward std of eval"),
    _define(
        "val/exception_rate",
        "Eval exception rate",
        "ratio",
        "share of eval rollouts that raised",
        None,
        False,
    ),
)

PIPELINE_RL_METRIC_DEFINITIONS: tuple[MetricDefinition, ...] = (
    _OBJECTIVE + _PIPELINE + _OFFPOLICY + _TRAINER + _EVAL
)
PIPELINE_RL_DASHBOARD_DEFAULT_METRICS: tuple[str, ...] = tuple(
    d.key for d in PIPELINE_RL_METRIC_DEFINITIONS if d.dashboard_default
)
PIPELINE_RL_SCORE_METRICS: tuple[str, ...] = tuple(
    d.key for d in PIPELINE_RL_METRIC_DEFINITIONS if d.score_component
)


def metric_definition(key: str) -> MetricDefinition | None:
    """The definition of ``key``: its own, else the family (``offpolicy/staleness_*``) it is in."""
    for definition in PIPELINE_RL_METRIC_DEFINITIONS:
        if definition.key == key:
            return definition
    for definition in PIPELINE_RL_METRIC_DEFINITIONS:
        if definition.key.endswith("*") and fnmatchcase(key, definition.key):
            return definition
    return None
