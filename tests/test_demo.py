"""``make demo`` in miniature: the same code on the tiny model, two training steps, its summary and plot."""

from __future__ import annotations

import json

import pytest

from artery.demos import demo

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_presets_fill_what_the_command_line_leaves_out():
    args = demo.parse_args(["--model", "tiny", "--steps", "3"])
    assert (args.base_model, args.task, args.steps, args.learning_rate) == (
        "artery/tiny-random",
        "half_alphabet",
        3,
        1e-2,
    )
    args = demo.parse_args([])
    assert (args.base_model, args.task) == ("SmolLM2-135M-Instruct", "lowercase")
    args = demo.parse_args(["--base-model", "/models/mine", "--task", "lowercase", "--learning-rate", "1e-5"])
    assert (args.base_model, args.learning_rate, args.max_tokens) == ("/models/mine", 1e-5, 20)


async def test_demo_runs_the_loop_and_writes_its_summary_and_plot(tmp_path):
    args = demo.parse_args(
        [
            "--model",
            "tiny",
            "--home",
            str(tmp_path / "demo"),
            "--steps",
            "2",
            "--group-size",
            "4",
            "--max-tokens",
            "6",
        ]
    )
    summary = await demo.run(args)
    saved = json.loads((tmp_path / "demo" / "summary.json").read_text())
    assert saved["steps"] == summary["steps"] == 2
    assert [p["step"] for p in saved["curve"]] == [0, 1]
    for point in saved["curve"]:  # where each step's time went: the trainer's inside the train call
        assert point["rollouts_s"] > 0 and 0 < point["trainer_s"] <= point["train_call_s"]
    assert [saved["held_out"][k]["step"] for k in ("before", "after")] == [0, 2]
    assert 0.0 <= saved["reward_start"] <= 1.0 and 0.0 <= saved["reward_end"] <= 1.0
    assert saved["reward_start"] == saved["held_out"]["before"]["sampled"]
    assert (tmp_path / "demo" / "reward_curve.png").stat().st_size > 1000
