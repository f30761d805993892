"""Which interpreter an inference replica runs under: the vLLM engine's replicas run from
``.venv-vllm`` (``make setup-vllm``), everything else from this interpreter; a missing venv is a
message naming the make target, before anything starts. (The engine itself: test_engine_vllm.py.)"""

from __future__ import annotations

import importlib.util
import sys

import pytest

import artery.ops.stack as stack_module
from artery.ops.cli import main as artery_main
from artery.ops.stack import EngineUnavailable, Stack, inference_python

VLLM_HERE = importlib.util.find_spec("vllm") is not None


@pytest.fixture
def no_vllm_venv(tmp_path, monkeypatch):
    monkeypatch.setattr(stack_module, "VLLM_VENV", tmp_path / ".venv-vllm")
    return tmp_path / ".venv-vllm"


def test_the_transformers_engine_and_other_services_run_from_this_interpreter():
    assert inference_python({}) == sys.executable
    assert inference_python({"ARTERY_INFERENCE_ENGINE": "transformers"}) == sys.executable


@pytest.mark.skipif(VLLM_HERE, reason="this interpreter has vllm: it would serve the vllm engine itself")
def test_a_missing_vllm_venv_names_the_make_target(no_vllm_venv):
    with pytest.raises(EngineUnavailable, match="make setup-vllm"):
        inference_python({"ARTERY_INFERENCE_ENGINE": "vllm"})
    # Half-built (no stamp: the install did not finish) counts as missing.
    (no_vllm_venv / "bin").mkdir(parents=True)
    (no_vllm_venv / "bin" / "python").touch()
    with pytest.raises(EngineUnavailable, match="make setup-vllm"):
        inference_python({"ARTERY_INFERENCE_ENGINE": "vllm"})


@pytest.mark.skipif(VLLM_HERE, reason="this interpreter has vllm: it would serve the vllm engine itself")
def test_the_vllm_engine_runs_from_the_vllm_venv(no_vllm_venv, tmp_path):
    (no_vllm_venv / "bin").mkdir(parents=True)
    (no_vllm_venv / "bin" / "python").touch()
    (no_vllm_venv / ".installed").touch()
    assert inference_python({"ARTERY_INFERENCE_ENGINE": "vllm"}) == str(no_vllm_venv / "bin" / "python")
    # ARTERY_VLLM_PYTHON wins, and must exist.
    other = tmp_path / "python"
    other.touch()
    env = {"ARTERY_INFERENCE_ENGINE": "vllm", "ARTERY_VLLM_PYTHON": str(other)}
    assert inference_python(env) == str(other)
    with pytest.raises(EngineUnavailable, match="no such interpreter"):
        inference_python({**env, "ARTERY_VLLM_PYTHON": str(tmp_path / "nope")})


@pytest.mark.skipif(VLLM_HERE, reason="this interpreter has vllm: it would serve the vllm engine itself")
def test_stack_starts_vllm_replicas_from_their_venv_and_refuses_without_it(no_vllm_venv, tmp_path):
    stack = Stack(home=tmp_path / "stack", nats_url="nats://127.0.0.1:1", database_url="postgresql://x")
    with pytest.raises(EngineUnavailable, match="make setup-vllm"):
        stack.start_service("inference-p-m", service="inference", env={"ARTERY_INFERENCE_ENGINE": "vllm"})
    assert "inference-p-m" not in stack.processes  # nothing was started


@pytest.mark.skipif(VLLM_HERE, reason="this interpreter has vllm: it would serve the vllm engine itself")
def test_artery_up_with_engine_vllm_and_no_venv_stops_before_starting_anything(no_vllm_venv, tmp_path):
    with pytest.raises(SystemExit) as stopped:
        artery_main(
            [
                "up",
                "--home",
                str(tmp_path / "home"),
                "--engine",
                "vllm",
                "--serve",
                "p/m=SmolLM2-135M-Instruct",
            ]
        )
    assert "make setup-vllm" in str(stopped.value)
    assert not (tmp_path / "home").exists()
