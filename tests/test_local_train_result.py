"""ART's ``LocalTrainResult`` and ``LocalServingUnavailableError`` from Artery's ``LocalBackend``, on
the real embedded stack and the tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest

import artery as art
from artery.shared.models import TINY
from artery.testing.agents import half_alphabet_rollout

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


async def test_train_returns_the_steps_checkpoint_and_serving_that_cannot_start_says_so(tmp_path):
    backend = art.LocalBackend(path=tmp_path / "artery")
    model = art.TrainableModel(name="local-result", project="names", base_model=TINY)
    try:
        await model.register(backend)
        groups = [
            art.TrajectoryGroup([await half_alphabet_rollout(model, max_tokens=6) for _ in range(4)])
            for _ in range(2)
        ]
        result = await backend.train(model, groups, learning_rate=1e-2)
        assert isinstance(result, art.LocalTrainResult) and isinstance(result, art.TrainResult)
        assert result.step == 1 and "step_total_s" in result.metrics
        assert result.checkpoint_path is not None
        step_directory = Path(result.checkpoint_path)
        assert step_directory.name == "000001" and (step_directory / "adapter").is_dir()

        # A replica that cannot start (an engine the inference service refuses): ART's error.
        backend.inference_env["ARTERY_INFERENCE_ENGINE"] = "no-such-engine"
        broken = art.TrainableModel(name="unserved", project="names", base_model=TINY)
        with pytest.raises(art.LocalServingUnavailableError, match="did not start serving"):
            await broken.register(backend)
    finally:
        await backend.close()
