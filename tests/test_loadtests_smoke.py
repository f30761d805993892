"""The ingest benchmark (``make bench``) runs end to end on a tiny load and reports sane figures."""

from __future__ import annotations

import json

from loadtests import ingest


def test_ingest_benchmark_quick(tmp_path, capsys):
    output = tmp_path / "ingest.json"
    returned = ingest.main(["--quick", "--groups", "6", "--group-size", "3", "--output", str(output)])

    result = json.loads(output.read_text())
    assert result == json.loads(json.dumps(returned))
    assert {
        "benchmark",
        "date",
        "machine",
        "durability",
        "config",
        "payload",
        "raw_publish",
        "end_to_end",
    } <= set(result)
    assert result["machine"]["cpu_count"] >= 1 and result["machine"]["python"]
    assert result["durability"]["postgres_durable"] is True

    raw, e2e = result["raw_publish"], result["end_to_end"]
    assert raw["trajectories_per_s"] > 0 and raw["groups_per_s"] > 0
    assert e2e["trajectories_per_s"] > 0 and e2e["groups_per_s"] > 0 and e2e["ratio_to_raw"] > 0
    assert 0 < e2e["latency_ms"]["p50"] <= e2e["latency_ms"]["p99"]
    assert e2e["ready_missing"] == 0 and e2e["ready_events"] == 6
    assert e2e["light_load_latency_ms"]["missing"] == 0 and e2e["light_load_latency_ms"]["p50"] > 0
    assert e2e["rows_expected"] == 18 and e2e["rows_verified"] == 18 and e2e["groups_stored"] == 6
    assert e2e["rows_ok"] is True
    assert {g["status"] for g in result["goals"].values()} <= {"PASS", "BELOW"}

    printed = capsys.readouterr().out
    assert "end to end" in printed and "rows verified" in printed
