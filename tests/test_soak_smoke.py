"""The soak benchmark (``make soak``) runs end to end for ~20 s and writes its time series.

It proves the machinery (probe, paced load, sampling, memory verdict, JSON), not performance.
"""

from __future__ import annotations

import json

import pytest

from loadtests import soak


@pytest.mark.slow
def test_soak_runs_briefly_and_writes_samples(tmp_path, capsys):
    output = tmp_path / "soak.json"
    returned = soak.main(
        [
            "--duration", "20",
            "--interval", "2",
            "--probe-groups", "400",
            "--warmup-groups", "20",
            "--group-size", "4",
            "--output", str(output),
        ]
    )  # fmt: skip

    result = json.loads(output.read_text())
    assert result == json.loads(json.dumps(returned))
    assert {"benchmark", "date", "machine", "config", "probe", "steady", "memory", "samples"} <= set(result)
    assert result["benchmark"] == "soak" and result["config"]["duration_s"] == 20

    probe, steady = result["probe"], result["steady"]
    assert probe["groups_per_s"] > 0 and probe["trajectories_per_s"] == pytest.approx(
        probe["groups_per_s"] * 4, rel=0.01
    )
    assert steady["target_groups_per_s"] == pytest.approx(0.8 * probe["groups_per_s"], rel=0.01)
    assert steady["published_groups"] > 0 and steady["published_per_s"] > 0
    assert steady["publish_errors"] == 0 and steady["duplicates"] == 0
    assert steady["rows_ok"] is True and steady["rows_verified"] == 4 * steady["published_groups"]
    assert (
        steady["latency_ms"]["p50"] is not None and steady["latency_ms"]["p50"] <= steady["latency_ms"]["p99"]
    )

    samples = result["samples"]
    assert 8 <= len(samples) <= 10  # one every 2 s for 20 s
    keys = {
        "t_s",
        "published_per_s",
        "stored_per_s",
        "trajectories_stored_per_s",
        "latency_p50_ms",
        "latency_p99_ms",
        "backlog_groups",
        "collector_rss_mb",
        "collector_cpu",
    }
    assert all(set(s) == keys for s in samples)
    assert [s["t_s"] for s in samples] == sorted(s["t_s"] for s in samples)
    assert all(s["collector_rss_mb"] > 0 for s in samples)
    assert sum(s["published_per_s"] for s in samples) > 0

    memory = result["memory"]
    assert isinstance(memory["flat"], bool)
    assert {"start_mb", "end_mb", "min_mb", "max_mb", "second_half", "limits"} <= set(memory)
    assert memory["second_half"]["samples"] >= 1

    printed = capsys.readouterr().out
    assert "maximum (probe burst)" in printed and "collector memory" in printed
