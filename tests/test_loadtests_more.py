"""The inference and training-loop benchmarks (``make bench``) run on a tiny load and report sane figures."""

from __future__ import annotations

import json

import pytest

from artery.demos.demo import PRESETS
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

    async_mode = result["modes"]["async"]
    discarded = (async_mode["discarded_stale_groups"], async_mode["discarded_equal_groups"])
    assert all(isinstance(n, int) and n >= 0 for n in discarded)

    printed = capsys.readouterr().out
    assert "generation (rollouts)" in printed and "until served" in printed
    assert f"not trained on: {discarded[0]} stale, {discarded[1]} with equal rewards" in printed


def test_trainer_step_benchmark_quick(tmp_path):
    from loadtests import trainer_step

    output = tmp_path / "trainer_step.json"
    trainer_step.main(["--quick", "--output", str(output)])
    result = json.loads(output.read_text())
    for part in ("artery_train_step", "trl_train_only", "trl_full_step", "artery_full_step"):
        assert result["per_step"][part]["median_ms"] > 0
    assert result["ratios_of_medians"]["train_trl_over_artery"] > 0
    assert result["artery_steps_trained"] > 0


# --- the serving comparison's result: pure functions on made-up figures -----------------------


def _figures(tokens_per_s: float, median: float | None = None) -> dict:
    return {
        "tokens_per_s": tokens_per_s,
        "median_round_tokens_per_s": median or tokens_per_s,
        "request_latency": {"n": 2, "min": 5.0, "p50": 10.0, "p99": 20.0, "max": 20.0},
    }


def _phase(**contenders: float) -> dict:
    return {
        "contenders": list(contenders),
        "figures": {name: _figures(v) for name, v in contenders.items()},
        "cpu_s": {},
        "other_share": 0.0,
        "seconds": 10.0,
        "load_average_1m_before": 1.0,
    }


def test_serving_ratios_come_from_the_phase_that_measured_both_sides():
    from loadtests.serving_result import assemble

    phases = [
        _phase(hf_generate=100.0, artery_transformers=90.0),
        _phase(artery_vllm=190.0, vllm_serve=200.0),
        _phase(artery_default=300.0, vllm_serve_lora=320.0, hf_generate=120.0),
        # artery_default again, beside the best server: this phase's figure, not the one above
        _phase(artery_default=360.0, vllm_cpu_best=450.0),
    ]
    out = assemble(phases, {}, {"rounds": 5}, {"cpu_count": 2})

    assert out["vllm_vs_vllm_serve"] == 0.95
    assert out["default_vs_best_cpu"] == 0.8
    assert out["default_vs_vllm_serve_lora"] == round(300 / 320, 3)
    assert out["default_vs_hf_generate"] == 2.5
    assert out["transformers_vs_hf_generate"] == 0.9
    ratios = out["serving"]["ratios"]
    assert ratios["default_vs_best_cpu"]["phase"] == 4
    assert ratios["default_vs_best_cpu"]["artery_default"] == 360.0
    assert ratios["default_vs_hf_generate"]["phase"] == 3
    targets = out["serving"]["targets"]
    assert targets["vllm_vs_vllm_serve"] == {"target": 0.95, "value": 0.95, "met": True}
    assert targets["default_vs_best_cpu"] == {"target": 0.9, "value": 0.8, "met": False}


def test_serving_ratios_not_measured_are_left_out_and_median_rounds_kept_apart():
    from loadtests.serving_result import assemble

    phase = _phase(artery_vllm=0.0, vllm_serve=0.0)
    phase["figures"] = {"artery_vllm": _figures(150.0, 160.0), "vllm_serve": _figures(200.0, 128.0)}
    out = assemble([phase], {}, {}, {})

    assert out["vllm_vs_vllm_serve"] == 0.75
    assert out["serving"]["ratios"]["vllm_vs_vllm_serve"]["median_round"] == 1.25
    assert "default_vs_best_cpu" not in out and set(out["serving"]["targets"]) == {"vllm_vs_vllm_serve"}


def test_serving_figures_of_rounds():
    from loadtests.chat_client import Round
    from loadtests.serving_result import figures

    rounds = [Round(2.0, 100, [1.0, 2.0]), Round(1.0, 100, [0.5, 1.0]), Round(4.0, 100, [3.0, 4.0])]
    f = figures(rounds, concurrency=2)

    assert f["completion_tokens"] == 300 and f["seconds"] == 7.0 and f["requests"] == 6
    assert f["tokens_per_s"] == round(300 / 7, 1)
    assert f["median_round_tokens_per_s"] == 50.0
    assert f["request_latency"]["n"] == 6 and f["request_latency"]["max"] == 4000.0
    assert figures([Round(1.0, 10)], concurrency=1)["request_latency"] is None  # in-process: none


def test_serving_result_replaces_its_keys_and_keeps_the_inference_benchmarks(tmp_path):
    from loadtests.serving_result import merge_into

    output = tmp_path / "inference.json"
    output.write_text(
        json.dumps({"benchmark": "inference", "throughput": {"x": 1}, "vllm_vs_vllm_serve": 0.5})
    )
    written = merge_into(output, {"serving": {"ratios": {}}, "default_vs_best_cpu": 0.93})

    assert json.loads(output.read_text()) == written
    assert written == {
        "benchmark": "inference",
        "throughput": {"x": 1},
        "serving": {"ratios": {}},
        "default_vs_best_cpu": 0.93,
    }  # the stale vllm_vs_vllm_serve of an older run is gone, not mixed with this run's


def test_serving_starts_each_server_once_and_stops_it_after_its_last_phase():
    from loadtests.serving_result import PHASES, phases_for, plan

    steps = plan(PHASES)
    assert [s.start for s in steps] == [
        ("artery_transformers",),
        ("artery_vllm", "vllm_serve"),
        ("artery_default", "vllm_serve_lora"),
        ("vllm_cpu_best",),
    ]
    assert [s.stop_after for s in steps] == [
        ("artery_transformers",),
        ("artery_vllm", "vllm_serve"),
        ("vllm_serve_lora",),
        ("artery_default", "vllm_cpu_best"),
    ]
    # at most two servers up at once, so no more than one waits while another is measured
    up: set[str] = set()
    for step in steps:
        up |= set(step.start)
        assert len(up) <= 2
        up -= set(step.stop_after)
    assert not up
    assert phases_for(["vllm_vs_vllm_serve"]) == (("artery_vllm", "vllm_serve"),)
    assert phases_for([]) == PHASES


class _RecordingServers:
    """Stands in for ``loadtests.serving_servers.Servers``: records the order of starts and waits."""

    def __init__(self, events: list[str]) -> None:
        self.events = events
        self.urls: dict[str, str] = {}

    def start(self, c) -> None:
        self.events.append(f"start {c.name}")

    def wait(self, name: str) -> None:
        self.events.append(f"wait {name}")
        self.urls[name] = f"http://{name}"


@pytest.mark.parametrize(
    ("one_at_a_time", "expected"),
    [
        # a GPU: each vLLM server has loaded before the next one starts profiling its memory
        (True, ["start a", "wait a", "start b", "wait b", "meanwhile"]),
        # the CPU: both load side by side while the HF baseline loads here
        (False, ["start a", "start b", "meanwhile", "wait a", "wait b"]),
    ],
)
def test_serving_servers_on_a_gpu_start_one_at_a_time(one_at_a_time, expected):
    from loadtests.serving import bring_up
    from loadtests.serving_servers import Contender

    events: list[str] = []
    said: list[str] = []
    cast = [Contender(name, name) for name in ("a", "b")]
    bring_up(
        _RecordingServers(events),
        cast,
        one_at_a_time=one_at_a_time,
        meanwhile=lambda: events.append("meanwhile"),
        say=said.append,
    )
    assert events == expected
    assert said == ["  a up at http://a", "  b up at http://b"]


def test_vllm_serve_gets_the_engines_own_arguments_as_flags():
    from loadtests.serving_result import serve_flags

    engine_args = {
        "model": "/weights",
        "enable_lora": True,
        "max_lora_rank": 16,
        "enable_sleep_mode": False,
        "dtype": "bfloat16",
        "logprobs_mode": "processed_logprobs",
        "enable_chunked_prefill": False,
        "max_model_len": None,
    }
    assert serve_flags(engine_args) == (
        "--enable-lora",
        "--max-lora-rank",
        "16",
        "--no-enable-sleep-mode",
        "--dtype",
        "bfloat16",
        "--logprobs-mode",
        "processed_logprobs",
        "--no-enable-chunked-prefill",
    )


def test_serving_table_shows_every_ratio_and_whether_its_target_is_met():
    from loadtests.serving_result import assemble, render

    phases = [_phase(artery_vllm=190.0, vllm_serve=200.0), _phase(artery_default=360.0, vllm_cpu_best=450.0)]
    phases[1].update(idle_wait_s=12.4, turns_not_idle=1)
    contenders = {name: {"what": name} for p in phases for name in p["figures"]}
    out = assemble(
        phases,
        contenders,
        {"base_model": "m", "concurrency": 32, "rounds": 5, "max_tokens": 48, "quick": False},
        {"cpu_count": 2, "load_average_1m_before": 0.5},
    )
    printed = render(out["serving"])

    assert "vllm_vs_vllm_serve" in printed and ">= 0.95: met" in printed
    assert "default_vs_best_cpu" in printed and ">= 0.9: BELOW" in printed
    phase_lines = [line for line in printed.splitlines() if line.startswith("  phase ")]
    assert phase_lines[0].endswith("turns did not wait for idle servers")  # an older result
    assert phase_lines[1].endswith("12.4 s waiting for idle servers, 1 turns began with one still busy")


# A process that computes until a line arrives on its stdin, then answers and sits idle; started
# by a parent that waits for it, so it is a descendant of the pid the benchmark knows.
_SPINNER = """
import select, sys
print("spinning", flush=True)
while not select.select([sys.stdin], [], [], 0)[0]:
    pass
sys.stdin.readline()
print("idle", flush=True)
sys.stdin.read()
"""


def test_a_turn_waits_until_the_other_servers_stop_computing():
    """``harness.until_idle``: a server's descendant that still computes holds the next turn back
    (until the limit, which says so); once it stops, the turn begins within a window."""
    import asyncio
    import subprocess
    import sys

    from loadtests.harness import IDLE_WINDOW_S, until_idle

    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys; subprocess.run([sys.executable, '-c', sys.argv[1]])",
            _SPINNER,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert parent.stdout is not None and parent.stdin is not None
        assert parent.stdout.readline() == "spinning\n"

        busy = asyncio.run(until_idle([parent.pid], timeout_s=1.0))
        assert not busy.settled and busy.waited_s >= 1.0

        parent.stdin.write("stop\n")
        parent.stdin.flush()
        assert parent.stdout.readline() == "idle\n"
        quiet = asyncio.run(until_idle([parent.pid], timeout_s=30.0))
        assert quiet.settled and quiet.waited_s < 30.0
        assert quiet.waited_s >= IDLE_WINDOW_S  # one window read, at least
    finally:
        parent.kill()
        parent.wait()
        for pipe in (parent.stdin, parent.stdout):  # the spinner's end of file: it exits
            if pipe is not None:
                pipe.close()


def test_inference_vllm_vs_serve_runs_the_serving_benchmarks_pair():
    args = inference.parse_args(["--vllm-vs-serve", "--rounds", "3", "--output", "x.json"])
    assert args == [
        "--only",
        "vllm_vs_vllm_serve",
        "--rounds",
        "3",
        "--max-tokens",
        "32",
        "--output",
        "x.json",
    ]


def test_the_lora_baseline_is_vllm_alone_without_arterys_extension():
    from loadtests.serving_result import stock_vllm_args

    engine_args = {
        "enable_lora": True,
        "dtype": "bfloat16",
        "worker_extension_cls": "artery.services.inference.engine.vllm_cpu_worker.CpuWorkerExtension",
    }
    assert stock_vllm_args(engine_args) == {"enable_lora": True, "dtype": "bfloat16"}


def test_trainer_throughput_benchmark_on_the_tiny_shape(tmp_path):
    from loadtests import trainer_throughput

    output = tmp_path / "trainer_throughput.json"
    args = ["--shape", "tiny", "--device", "cpu", "--groups", "2", "--group-size", "4"]
    args += ["--prompt-tokens", "16", "--completion-tokens", "24", "--steps", "1", "--warmup", "1"]
    trainer_throughput.main([*args, "--output", str(output)])
    result = json.loads(output.read_text())
    artery, baseline = result["contenders"]["artery"], result["contenders"]["baseline"]
    # Both sides train every completion token of the step, and Artery's adapter really moved.
    assert artery["trained_tokens_per_step"] == baseline["trained_tokens_per_step"] == 2 * 4 * 24
    assert artery["total_tokens_per_step"] == baseline["total_tokens_per_step"] > 2 * 4 * 24
    assert artery["trained_tokens_per_s"] > 0 and baseline["trained_tokens_per_s"] > 0
    assert result["artery_vs_baseline"] > 0
    assert result["artery_adapter_moved"] > 0


def test_trainer_precision_benchmark_on_the_tiny_model(tmp_path):
    from artery.shared.cpu import cpu_has_bf16
    from loadtests import trainer_precision

    output = tmp_path / "trainer_precision.json"
    args = ["--base-model", "artery/tiny-random", "--prompt-tokens", "8", "--completion-tokens", "6"]
    args += ["--group-size", "4", "--steps", "1", "--warmup", "0", "--threads", "1"]
    trainer_precision.main([*args, "--output", str(output)])
    result = json.loads(output.read_text())
    off, bf16 = result["modes"]["off"], result["modes"]["bfloat16"]
    # Both modes train the same tokens: every completion token of the step.
    assert off["trained_tokens_per_step"] == bf16["trained_tokens_per_step"] == 2 * 4 * 6
    assert off["median_step_s"] > 0 and bf16["median_step_s"] > 0 and result["bf16_vs_float32"] > 0
    # The passes really ran in bf16: their logprobs differ from float32's, by bf16's rounding.
    assert 0 < result["logprob_gap"]["mean"] <= result["logprob_gap"]["max"] < 0.5
    assert result["cpu_has_bf16"] == cpu_has_bf16()
    assert result["auto_picks"] == ("bfloat16" if cpu_has_bf16() else "off")


def test_trainer_shared_prompt_benchmark_on_the_tiny_model(tmp_path):
    from loadtests import trainer_shared_prompt

    output = tmp_path / "trainer_shared_prompt.json"
    args = ["--base-model", "artery/tiny-random", "--prompt-tokens", "12", "--completion-tokens", "6"]
    args += ["--groups", "1", "--group-size", "4", "--steps", "1", "--warmup", "0", "--threads", "1"]
    trainer_shared_prompt.main([*args, "--output", str(output)])
    result = json.loads(output.read_text())
    assert set(result["modes"]) == {"whole", "shared", "whole float32", "shared float32"}
    for figures in result["modes"].values():
        assert figures["trained_tokens_per_step"] == 4 * 6 and figures["median_step_s"] > 0
    assert result["shared_vs_whole"] > 0 and result["shared_vs_whole_float32"] > 0
    # One group in the micro-batch: its whole prompt, chat template and all, is shared.
    micro = result["micro_batch"]
    assert micro["rows"] == 4 and 12 < micro["shared_prefix"] < micro["length"]
    assert result["logprob_gap_max"] < 1e-4  # the same logprobs: float rounding only


def test_the_loop_benchmark_trains_a_real_model_at_the_demos_rate():
    """At the tiny model's 1e-2, SmolLM2 collapses to one answer within a few steps and the
    asynchronous mode stops (every group's rewards equal); a real model gets the demo's rate."""
    assert loop.parse_args([]).learning_rate == loop.TINY_LEARNING_RATE
    assert loop.parse_args(["--base-model", "smollm2"]).learning_rate == loop.LEARNING_RATE
    assert loop.parse_args(["--base-model", "smollm2", "--learning-rate", "0.5"]).learning_rate == 0.5
    assert loop.LEARNING_RATE == PRESETS["smollm2"]["learning_rate"]
