"""ART's newest ``art.__all__`` on ``import artery as art``: every name is there, and the ones that
describe what ART does differently from Artery (Megatron) say so instead of failing."""

from __future__ import annotations

import logging

import msgspec
import pytest

import artery as art
from artery import megatron
from artery.utils import art_settings

#: ART main's ``art.__all__`` (37 names).
ART_NEWEST_ALL = (
    "dev", "current_trajectory", "no_capture", "gather_trajectories", "gather_trajectory_groups",
    "trajectory_group_batches", "Backend", "LocalTrainResult", "LoRAConfig",
    "LocalServingUnavailableError", "MegatronRuntimeConfig", "MegatronTopologyConfig",
    "MetricDefinition", "PipelineAutotuneConfig", "PipelineRuntimeConfig",
    "PIPELINE_RL_DASHBOARD_DEFAULT_METRICS", "PIPELINE_RL_METRIC_DEFINITIONS",
    "PIPELINE_RL_SCORE_METRICS", "get_megatron_runtime_config", "init_megatron_runtime_config",
    "ServerlessBackend", "ServerlessTrainResult", "Messages", "MessagesAndChoices", "Tools", "Model",
    "TrainableModel", "retry", "TrainSFTConfig", "TrainConfig", "TrainResult", "Trajectory",
    "TrajectoryGroup", "trajectory", "trajectory_group", "capture_yielded_trajectory",
    "yield_trajectory",
)  # fmt: skip


@pytest.mark.parametrize("name", ART_NEWEST_ALL)
def test_every_name_of_arts_newest_all_is_on_artery(name):
    assert len(ART_NEWEST_ALL) == 37
    assert hasattr(art, name), f"art.{name} is missing"
    assert name in art.__all__


def test_metric_tables_are_arts_shape_and_name_artery_metrics():
    keys = [d.key for d in art.PIPELINE_RL_METRIC_DEFINITIONS]
    assert len(keys) == len(set(keys)), "a key is defined twice"
    assert all(isinstance(d, art.MetricDefinition) for d in art.PIPELINE_RL_METRIC_DEFINITIONS)
    assert "objective/score" in art.PIPELINE_RL_SCORE_METRICS
    assert "objective/score" in art.PIPELINE_RL_DASHBOARD_DEFAULT_METRICS
    assert set(art.PIPELINE_RL_SCORE_METRICS) <= set(keys)
    assert set(art.PIPELINE_RL_DASHBOARD_DEFAULT_METRICS) <= set(keys)
    sections = {k.split("/")[0] for k in keys}
    assert {"objective", "throughput", "offpolicy", "queue", "costs"} <= sections
    with pytest.raises(ValueError, match="kind"):
        art.MetricDefinition(key="a/b", title="t", description="d", kind="speed")  # type: ignore[arg-type]


def test_megatron_settings_are_kept_and_said_to_do_nothing(monkeypatch, caplog):
    monkeypatch.setattr(megatron, "_runtime_config", None)
    monkeypatch.setattr(art_settings, "_noted", set())  # the note is once per process
    with pytest.raises(RuntimeError, match="no Megatron"):
        art.get_megatron_runtime_config()
    topology = art.MegatronTopologyConfig(tp=2, cp=1, ep=1)
    with caplog.at_level(logging.WARNING):
        config = art.init_megatron_runtime_config(topology=topology, packed_sequence_length=8192)
    assert "torch.distributed" in caplog.text and "MegatronRuntimeConfig" in caplog.text
    assert art.get_megatron_runtime_config() is config
    assert config.topology.tp == 2 and config.packed_sequence_length == 8192
    # The same again is fine (ART's rule); other settings are refused.
    same = {"topology": {"tp": 2, "cp": 1, "ep": 1}, "packed_sequence_length": 8192}
    assert art.init_megatron_runtime_config(same) == config
    with pytest.raises(ValueError, match="already initialized"):
        art.init_megatron_runtime_config(topology=topology, packed_sequence_length=4096)
    with pytest.raises(ValueError, match=">= 1"):
        art.MegatronTopologyConfig(tp=0)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"topology": {}}, art.MegatronRuntimeConfig)  # packed_sequence_length required


def test_local_serving_unavailable_is_a_runtime_error_that_names_itself():
    error = art.LocalServingUnavailableError("replica exited")
    assert isinstance(error, RuntimeError) and "replica exited" in str(error)
