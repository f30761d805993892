"""``art.LoRAConfig`` reaches the trainer, ART's train keywords reach the loss, and a changed
adapter shape is a clear error from the trainer too: through the real services."""

from __future__ import annotations

import json

import msgspec
import pytest

import artery as art
from artery.schemas import LoraSpec
from artery.shared import subjects
from artery.shared.models import TINY
from artery.shared.registry import read_record
from artery.testing.agents import half_alphabet_rollout

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


async def spread_group(model: art.TrainableModel) -> art.TrajectoryGroup:
    """Four rollouts with rewards 0 and 1 alternating, so the group always carries a gradient."""
    group = await art.TrajectoryGroup(half_alphabet_rollout(model, max_tokens=4) for _ in range(4))
    for i, trajectory in enumerate(group):
        trajectory.reward = float(i % 2)
    return group


async def test_lora_config_shapes_the_adapter_and_cannot_change_once_trained(tmp_path):
    backend = art.LocalBackend(path=tmp_path / "artery")
    model = art.TrainableModel(
        name="shaped",
        project="lora",
        base_model=TINY,
        lora_config=art.LoRAConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj", "lm_head"]),
    )
    try:
        await model.register(backend)
        # ART's keywords on the way in: ppo=True selects the clipped PPO loss.
        result = await model.train(
            [await spread_group(model)],
            config=art.TrainConfig(learning_rate=1e-3),
            _config=art.dev.TrainConfig(ppo=True, epsilon=0.1),
        )
        assert result.step == 1 and result.metrics["trained"] == 1.0
        step_dir = backend.path / "stack" / "checkpoints" / "lora" / "shaped" / "000001"
        adapter = json.loads((step_dir / "adapter" / "adapter_config.json").read_text())
        assert adapter["r"] == 4 and adapter["lora_alpha"] == 8
        assert set(adapter["target_modules"]) == {"q_proj", "v_proj", "lm_head"}

        # The record is the agent's to write: one that names another shape is refused by the
        # trainer with the reason, at once (not retried, not trained on a mismatched adapter).
        kv = await (await backend._js()).key_value(subjects.MODELS_BUCKET)
        found = await read_record(kv, "lora", "shaped")
        changed = msgspec.structs.replace(found.record, lora=LoraSpec(rank=8))
        await kv.put(subjects.model_key("lora", "shaped"), msgspec.json.encode(changed))
        with pytest.raises(art.TrainingFailed, match="cannot change") as failed:
            await model.train([await spread_group(model)], config=art.TrainConfig(learning_rate=1e-3))
        assert failed.value.retriable is False
        assert await model.get_step() == 1
    finally:
        await backend.close()
