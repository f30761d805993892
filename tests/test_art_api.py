"""ART's public API, name by name, so that the list cannot regress; then an ART-shaped script that
exercises each name once against the real services, changed from ART only in its import."""

from __future__ import annotations

import inspect
import json

import pytest

import artery as art
from artery.local import LocalBackend
from artery.shared.models import TINY

#: ART 0.5.18's names that ART users reach (``../shared/ART.md`` §1), as attribute paths from
#: ``art``; ``mcp`` and ``langgraph`` are imported as modules (optional extras, as in ART).
ART_NAMES = [
    "Backend",
    "LocalBackend",
    "local.LocalBackend",
    "local.backend.LocalBackend",
    "Model",
    "TrainableModel",
    "Trajectory",
    "TrajectoryGroup",
    "History",
    "gather_trajectories",
    "gather_trajectory_groups",
    "trajectory_group_batches",
    "TrainConfig",
    "TrainSFTConfig",
    "TrainResult",
    "Messages",
    "MessagesAndChoices",
    "Tools",
    "LoRAConfig",
    "retry",
    "dev",
    "dev.TrainConfig",
    "dev.InternalModelConfig",
    "dev.LoRAConfig",
    "auto_trajectory",
    "capture_auto_trajectory",
    "yield_trajectory",
    "capture_yielded_trajectory",
    "utils.iterate_dataset",
    "utils.limit_concurrency",
    "utils.retry",
    "rewards.ruler",
    "rewards.ruler_score_group",
    "Model.register",
    "Model.openai_client",
    "Model.litellm_completion_params",
    "Model.get_inference_name",
    "Model.log",
    "Model.get_step",
    "TrainableModel.train",
    "TrainableModel.train_sft",
    "TrainableModel.delete_checkpoints",
    "Backend.train",
    "Backend.close",
    "mcp.MCPTool",
    "mcp.MCPResource",
    "mcp.GeneratedScenario",
    "mcp.GeneratedScenarioCollection",
    "mcp.complete_task_tool",
    "mcp.generate_scenarios",
    "langgraph.wrap_rollout",
    "langgraph.init_chat_model",
    "pipeline_trainer.PipelineTrainer",
    "pipeline_trainer.make_group_rollout_fn",
]


@pytest.mark.parametrize("path", ART_NAMES)
def test_art_name_exists(path):
    import importlib

    head, *rest = path.split(".")
    obj = getattr(art, head, None) or importlib.import_module(f"artery.{head}")
    for part in rest:
        obj = getattr(obj, part, None) or importlib.import_module(f"{obj.__name__}.{part}")
    assert obj is not None
    if path.startswith(("Model.", "TrainableModel.", "Backend.")):
        assert callable(obj), path


def test_signatures_keep_arts_keywords():
    keywords = {
        art.Model.__init__: {"name", "project", "entity", "id", "config", "base_path", "report_metrics"},
        art.TrainableModel.__init__: {
            "name",
            "project",
            "base_model",
            "run_id",
            "lora_config",
            "_internal_config",
        },
        art.TrainableModel.train: {"trajectory_groups", "config", "_config", "verbose"},
        art.TrainableModel.train_sft: {"trajectories", "config", "_config", "verbose"},
        art.Model.log: {"trajectories", "split", "metrics", "step"},
        art.gather_trajectory_groups: {"groups", "pbar_desc", "max_exceptions", "max_metrics", "after_each"},
        art.trajectory_group_batches: {
            "groups",
            "batch_size",
            "max_batch_exceptions",
            "max_concurrent_batches",
        },
        art.utils.iterate_dataset: {"dataset", "groups_per_step", "num_epochs", "initial_step", "use_tqdm"},
        art.utils.limit_concurrency: {"n", "derive_key"},
        art.LocalBackend.__init__: {"in_process", "path", "gpu_cost_per_hour_usd"},
    }
    for function, names in keywords.items():
        assert names <= set(inspect.signature(function).parameters), function


def reward_of(text: str) -> float:
    """The tiny random model's answers vary: a reward that splits them gives groups a gradient."""
    return float(len(text) % 2)


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_an_art_script_runs_with_only_the_import_changed(tmp_path):
    """The shape of ART's examples: dataset → rollouts → groups → train → log, plus SFT, the
    auto-captured and yielded trajectories, batches and checkpoint retention."""
    backend = LocalBackend(path=str(tmp_path / "artery"))
    model = art.TrainableModel(
        name="conform",
        project="art-api",
        base_model=TINY,
        lora_config=art.LoRAConfig(rank=8, alpha=16),
        _internal_config=art.dev.InternalModelConfig(chat_template_kwargs={}),
    )
    calls = {"attempts": 0}

    @art.retry(max_attempts=3, delay=0.01)
    @art.utils.limit_concurrency(4)
    async def rollout(model: art.TrainableModel, scenario: str) -> art.Trajectory:
        calls["attempts"] += 1
        messages: art.Messages = [{"role": "user", "content": scenario}]
        client = model.openai_client()
        completion = await client.chat.completions.create(
            model=model.get_inference_name(), messages=messages, max_tokens=4, logprobs=True
        )
        choice = completion.choices[0]
        trajectory = art.Trajectory(messages_and_choices=[*messages, choice], reward=0.0)
        trajectory.reward = reward_of(choice.message.content or "")
        return trajectory.finish()

    async def auto_rollout(model: art.TrainableModel, scenario: str) -> None:
        client = model.openai_client()
        completion = await client.chat.completions.create(
            model=model.get_inference_name(),
            messages=[{"role": "user", "content": scenario}],
            max_tokens=4,
            logprobs=True,
        )
        art.auto_trajectory(required=True).reward = reward_of(completion.choices[0].message.content or "")

    async def yielding_rollout(model: art.TrainableModel, scenario: str) -> None:
        art.yield_trajectory(await rollout(model, scenario))

    try:
        await model.register(backend)
        scenarios = [f"say {w}" for w in ("a", "b", "c", "d")]
        for batch in art.utils.iterate_dataset(scenarios, groups_per_step=2, num_epochs=1):
            groups = await art.gather_trajectory_groups(
                (art.TrajectoryGroup(rollout(model, s) for _ in range(4)) for s in batch.items),
                pbar_desc="gather",
                max_exceptions=0,
            )
            result = await backend.train(model, groups, learning_rate=1e-3, ppo=False)
            assert result.step == batch.step + 1
            await model.log(groups, metrics=result.metrics, step=result.step, split="train")

        # The other ways ART hands over trajectories: captured from the client, yielded, batched.
        captured = [await art.capture_auto_trajectory(auto_rollout(model, "say e")) for _ in range(4)]
        yielded = [await art.capture_yielded_trajectory(yielding_rollout(model, "say f")) for _ in range(4)]
        assert all(t.messages_and_choices for t in captured + yielded)
        async for groups in art.trajectory_group_batches(
            (art.TrajectoryGroup(rollout(model, s) for _ in range(2)) for s in scenarios), batch_size=4
        ):
            groups += [art.TrajectoryGroup(captured), art.TrajectoryGroup(yielded)]
            result = await model.train(groups, config=art.TrainConfig(learning_rate=1e-3))
        assert result.step == 3

        # Supervised fine-tuning through the same trainer: the step advances, the adapter is served.
        examples = [
            art.Trajectory(
                messages_and_choices=[
                    {"role": "user", "content": s},
                    {"role": "assistant", "content": s.split()[-1]},
                ]
            )
            for s in scenarios
        ]
        sft = await model.train_sft(examples, art.TrainSFTConfig(learning_rate=1e-3, batch_size=2))
        assert sft.step == 4 and await model.get_step() == 4

        # Validation is logged as ART lays it out: history.jsonl and a parquet file per step.
        val = await art.gather_trajectory_groups(
            [art.TrajectoryGroup(rollout(model, "say g") for _ in range(2))], pbar_desc="val"
        )
        await model.log(val, split="val")
        model_dir = tmp_path / "artery" / "art-api" / "models" / "conform"
        history = [json.loads(line) for line in (model_dir / "history.jsonl").read_text().splitlines()]
        assert {row["step"] for row in history} >= {1, 2, 3, 4}
        assert any("val/reward" in row for row in history)
        import pyarrow.parquet as pq

        assert pq.read_table(model_dir / "trajectories" / "val" / "0004.parquet").num_rows == 2
        assert pq.read_table(model_dir / "trajectories" / "train" / "0001.parquet").num_rows == 8

        applied = await model.delete_checkpoints("reward_mean")
        assert 4 in applied.kept
        assert calls["attempts"] >= 2 * 2 * 4  # every rollout of the two training steps ran
    finally:
        await backend.close()
