"""A service checks its settings before anything heavy: an invalid one ends the process at once,
the variable named, before torch (seconds to import) or a connection."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from artery.services.inference.settings import PREFIX as INFERENCE
from artery.services.inference.settings import InferenceSettings
from artery.services.trainer.settings import PREFIX as TRAINER
from artery.services.trainer.settings import TrainerSettings
from artery.shared.errors import ConfigError
from artery.shared.runtime import CONFIG_EXIT_STATUS
from artery.shared.settings import load

#: What a service must not have imported when it refuses a setting.
HEAVY = {"torch", "transformers", "vllm", "peft"}


def test_an_invalid_setting_names_its_variable_and_not_its_value():
    with pytest.raises(ConfigError, match=r"^invalid setting ARTERY_TRAINER_LORA_RANK: Expected `int` >= 1$"):
        load(TrainerSettings, TRAINER, {"ARTERY_TRAINER_LORA_RANK": "0"})
    # A value may be a secret set in the wrong variable: the message never repeats it.
    with pytest.raises(ConfigError, match=r"^invalid setting ARTERY_INFERENCE_PORT: ") as refused:
        load(InferenceSettings, INFERENCE, {"ARTERY_INFERENCE_PORT": "s3cret"})
    assert "s3cret" not in str(refused.value)


def _imported(importtime_log: str) -> set[str]:
    """Top-level packages named by ``python -X importtime`` (``import time: self | total | name``)."""
    names = set()
    for line in importtime_log.splitlines():
        if line.startswith("import time:") and "|" in line:
            names.add(line.rsplit("|", 1)[1].strip().split(".")[0])
    return names


@pytest.mark.parametrize(
    ("service", "variable", "value"),
    [
        ("collector", "ARTERY_COLLECTOR_BATCH_SIZE", "0"),
        ("reward", "ARTERY_REWARD_MAX_ATTEMPTS", "many"),
        ("trainer", "ARTERY_TRAINER_LORA_RANK", "abc"),
        ("publisher", "ARTERY_PUBLISHER_BATCH_SIZE", "0"),
        ("inference", "ARTERY_INFERENCE_MAX_BATCH_SIZE", "0"),
        ("console", "ARTERY_CONSOLE_PAGE_SIZE", "all"),
    ],
)
def test_a_service_refuses_an_invalid_setting_before_heavy_imports(service, variable, value):
    # Nothing else of Artery's: no stack to follow, no server to reach (none is running).
    env = {k: v for k, v in os.environ.items() if not k.startswith("ARTERY_")}
    env[variable] = value
    run = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", f"artery.services.{service}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    said = [line for line in run.stderr.splitlines() if not line.startswith("import time:")]
    assert run.returncode == CONFIG_EXIT_STATUS, "\n".join(said[-30:])
    assert any(variable in line and "invalid setting" in line for line in said), "\n".join(said[-30:])
    assert not any("Traceback" in line for line in said), "\n".join(said[-30:])
    imported = _imported(run.stderr)
    assert "artery" in imported  # the log is read right: the service's own modules are in it
    assert not HEAVY & imported, f"{service} imported {sorted(HEAVY & imported)} before refusing"


def test_the_gpu_share_reaches_the_vllm_engine_and_is_bounded():
    """Two vLLM engines (or one and a trainer) share a GPU only if each takes less than all of it."""
    from artery.services.inference.main import make_engine

    env = {
        "ARTERY_INFERENCE_PROJECT": "p",
        "ARTERY_INFERENCE_MODEL": "m",
        "ARTERY_INFERENCE_BASE_MODEL": "/models/base",
        "ARTERY_INFERENCE_ENGINE": "vllm",
        "ARTERY_INFERENCE_GPU_MEMORY_UTILIZATION": "0.35",
    }
    settings = load(InferenceSettings, INFERENCE, env)
    assert settings.gpu_memory_utilization == 0.35
    engine = make_engine(settings)  # vLLM itself is imported only when the engine starts
    assert engine._settings["gpu_memory_utilization"] == 0.35
    for bad in ("0", "1.5"):
        with pytest.raises(ConfigError, match="ARTERY_INFERENCE_GPU_MEMORY_UTILIZATION"):
            load(InferenceSettings, INFERENCE, {**env, "ARTERY_INFERENCE_GPU_MEMORY_UTILIZATION": bad})
