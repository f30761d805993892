"""The scale-out and control-plane benchmarks (``make bench``, issue #30) run on a tiny load and
report what the issue's bar reads: steps/s for 1 and 2 trainer workers, no step out of order,
nothing lost, every replica's pause acked."""

from __future__ import annotations

import json

import pytest

from loadtests import control_plane, scale_out

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


def test_scale_out_benchmark_quick(tmp_path, capsys):
    output = tmp_path / "scale_out.json"
    returned = scale_out.main(
        ["--quick", "--models", "1", "--steps", "2", "--stall-s", "60", "--output", str(output)]
    )

    result = json.loads(output.read_text())
    assert result == json.loads(json.dumps(returned))
    assert set(result["workers"]) == {"1", "2"}
    for workers, phase in result["workers"].items():
        assert phase["requests"] == 4 and phase["steps"] == 4, (workers, phase)
        assert phase["steps_per_s"] > 0
        assert sum(phase["by_worker"].values()) == 4
        shares = phase["tenants"]["projects"]
        assert set(shares) == {"alpha", "beta"} and all(t["steps"] == 2 for t in shares.values())
    assert len(result["workers"]["2"]["by_worker"]) <= 2
    assert result["speedup"] == pytest.approx(
        result["workers"]["2"]["steps_per_s"] / result["workers"]["1"]["steps_per_s"], abs=0.01
    )
    assert result["order_violations"] == 0 and result["lost"] == 0 and result["failed"] == 0
    assert result["machine"]["load_average_1m_before"] is not None
    assert "speedup 2 over 1" in capsys.readouterr().out


def test_control_plane_benchmark_quick(tmp_path, capsys):
    output = tmp_path / "control_plane.json"
    argv = ["--replicas", "6", "--models", "2", "--hosts", "2", "--heartbeat-s", "1", "--idle-s", "2"]
    returned = control_plane.main([*argv, "--rounds", "2", "--output", str(output)])

    result = json.loads(output.read_text())
    assert result == json.loads(json.dumps(returned))
    assert result["replicas_registered"] == 6 and result["replicas_per_model"] == 3
    assert result["failures"] == 0, result["errors"]
    for block, pauses in (("pause", 4), ("concurrent", 4)):
        for key in ("pause_acked_ms", "pause_call_ms", "resume_acked_ms", "resume_call_ms"):
            figures = result[block][key]
            assert figures["n"] == pauses and 0 < figures["p50"] <= figures["p99"], (block, key)
    # Six replicas beating every second: about six puts a second, nothing else while idle.
    idle = result["traffic"]["idle"]
    assert 2 <= idle["heartbeats"]["msgs_per_s"] <= 12 and idle["control_requests"]["msgs"] == 0
    during = result["traffic"]["during_pause_rounds"]
    assert during["control_requests"]["msgs"] == 2 * 2 * 2  # a pause and a resume per model and round
    assert "pause acked" in capsys.readouterr().out
