"""``make demo`` in miniature: the same code, two training steps, its summary and plot."""

from __future__ import annotations

import argparse
import json

import pytest

from artery import demo

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


async def test_demo_runs_the_loop_and_writes_its_summary_and_plot(tmp_path):
    args = argparse.Namespace(
        home=str(tmp_path / "demo"),
        base_model="artery/tiny-random",
        steps=2,
        groups=2,
        group_size=4,
        max_tokens=6,
        learning_rate=1e-2,
        device="cpu",
        engine="transformers",
    )
    summary = await demo.run(args)
    saved = json.loads((tmp_path / "demo" / "summary.json").read_text())
    assert saved["steps"] == summary["steps"] == 2
    assert [p["step"] for p in saved["curve"]] == [0, 1, 2]
    assert 0.0 <= saved["reward_start"] <= 1.0 and 0.0 <= saved["reward_end"] <= 1.0
    assert (tmp_path / "demo" / "reward_curve.png").stat().st_size > 1000
