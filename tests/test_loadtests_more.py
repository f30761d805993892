"""The inference and training-loop benchmarks (``make bench``) run on a tiny load and report sane figures."""

from __future__ import annotations

import json

import pytest

from loadtests import inference, loop

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_inference_benchmark_quick(tmp_path, capsys):
    output = tmp_path / "inference.json"
    returned = inference.main(["--quick", "--concurrency", "4", "--max-tokens", "8", "--output", str(output)])

    result = json.loads(output.read_text())
    assert result == json.loads(json.dumps(returned))
    assert {"benchmark", "date", "machine", "config", "throughput", "pause", "adapter_load"} <= set(result)
    assert result["config"]["concurrency"] == 4 and result["config"]["quick"] is True

    throughput = result["throughput"]
    for part in ("artery_http", "engine_in_process", "hf_generate"):
        figures = throughput[part]
        assert figures["requests"] == 4 and figures["completion_tokens"] > 0
        assert figures["tokens_per_s"] > 0 and figures["requests_per_s"] > 0 and figures["seconds"] > 0
    assert throughput["ratio_tokens_per_s"] > 0 and throughput["ratio_engine_tokens_per_s"] > 0
    assert 0 < throughput["artery_http"]["request_latency"]["p50"]

    pause = result["pause"]
    assert pause["replicas"] == 2
    for key in (
        "pause_call",
        "pause_scatter_gather",
        "resume_call",
        "resume_scatter_gather",
        "pause_under_load",
    ):
        assert 0 < pause[key]["p50"] <= pause[key]["p99"] <= pause[key]["max"]

    adapters = result["adapter_load"]
    assert adapters["steps"] == 1 and adapters["adapter_bytes"] > 0
    assert set(adapters["published_to_served"]) == {"replica-a", "replica-b"}
    assert adapters["published_to_served_everywhere"]["p50"] > 0 and adapters["first_everywhere_ms"] > 0

    printed = capsys.readouterr().out
    assert (
        "HF model.generate" in printed
        and "pause_replicas call" in printed
        and "published -> served" in printed
    )


def test_loop_benchmark_quick(tmp_path, capsys):
    output = tmp_path / "loop.json"
    returned = loop.main(["--quick", "--group-size", "4", "--output", str(output)])

    result = json.loads(output.read_text())
    assert result == json.loads(json.dumps(returned))
    assert {"benchmark", "date", "machine", "config", "startup_s", "mean_s", "share", "iterations"} <= set(
        result
    )
    assert result["config"]["iterations"] == 2 and len(result["iterations"]) == 2
    assert [it["step"] for it in result["iterations"]] == [1.0, 2.0]

    mean = result["mean_s"]
    for part in ("generation", "publish_groups", "pause", "training", "save", "until_served", "total"):
        assert mean[part] > 0, part
    assert mean["train_call"] < mean["total"] and mean["rest"] > 0
    assert sum(mean[p] for p in loop.PARTS) == pytest.approx(mean["total"], rel=1e-3, abs=1e-3)
    assert sum(result["share"][p] for p in loop.PARTS) == pytest.approx(1.0, abs=1e-2)

    printed = capsys.readouterr().out
    assert "generation (rollouts)" in printed and "until served" in printed


def test_trainer_step_benchmark_quick(tmp_path):
    from loadtests import trainer_step

    output = tmp_path / "trainer_step.json"
    trainer_step.main(["--quick", "--output", str(output)])
    result = json.loads(output.read_text())
    for part in ("artery_train_step", "trl_train_only", "trl_full_step", "artery_full_step"):
        assert result["per_step"][part]["median_ms"] > 0
    assert result["ratios_of_medians"]["train_trl_over_artery"] > 0
    assert result["artery_steps_trained"] > 0
