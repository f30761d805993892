"""ART's own programs call more than its current API: the settings of its engines, its older
spellings and its pydantic methods. Each is accepted here (mapped, or said once to have no effect),
one test per item; those whose behaviour needs the services run against the real ones."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest

import artery as art
from artery.local import LocalBackend
from artery.schemas import TrainConfig
from artery.shared.models import TINY
from artery.testing.judge import scores_json, serve_scripted_judge
from artery.utils.base_model import BaseModelUnavailable
from artery.utils.model_files import best_step_in_history
from artery.utils.service_settings import apply_model_settings

#: What ``art.dev`` exports in ART 0.3.11 (its examples' ``art.dev.InitArgs(...)``) and in ART's
#: newest main (``src/art/dev/__init__.py``'s ``__all__``).
ART_DEV_NAMES = {
    "EngineArgs",
    "get_model_config",
    "InternalModelConfig",
    "InitArgs",
    "PeftArgs",
    "TrainerArgs",
    "get_openai_server_config",
    "OpenAIServerConfig",
    "ServerArgs",
    "TrainConfig",
    "BackendModelConfig",
    "LoRAConfig",
    "RolloutWeightUpdateMode",
    "TinkerArgs",
    "TinkerNativeArgs",
    "TinkerTrainingClientArgs",
    "VllmRuntimeArgs",
    "is_dedicated_mode",
    "is_external_vllm_mode",
    "TrainSFTConfig",
    "LossType",
    "DEFAULT_MAX_COMPLETION_LENGTH",
    "validate_dedicated_config",
}

#: The configuration ART's 2048 example sets on its model after construction (a T4's settings).
T4_CONFIG = art.dev.InternalModelConfig(
    init_args=art.dev.InitArgs(max_seq_length=512),
    engine_args=art.dev.EngineArgs(enforce_eager=True, gpu_memory_utilization=0.8, num_scheduler_steps=1),
    peft_args=art.dev.PeftArgs(r=4, lora_alpha=8, random_state=3407),
    trainer_args=art.dev.TrainerArgs(max_grad_norm=0.5, optim="paged_adamw_8bit"),
    tinker_args=art.dev.TinkerArgs(renderer_name="qwen3"),
)


@pytest.fixture
def noted(caplog):
    """The settings said to have no effect, each as often as it was said."""
    from artery.utils import art_settings

    art_settings._noted.clear()  # once per process: start this test with none said
    caplog.set_level(logging.WARNING, logger="artery.dev")

    def said() -> list[str]:
        return [
            r.getMessage().split(" has no effect")[0].removeprefix("ART setting ") for r in caplog.records
        ]

    return said


def test_every_art_dev_name_exists():
    missing = sorted(n for n in ART_DEV_NAMES if not hasattr(art.dev, n))
    assert not missing
    assert set(art.dev.__all__) >= ART_DEV_NAMES
    # ART's TypedDicts are plain dicts, built with any of ART's keys.
    assert art.dev.InitArgs(max_seq_length=8192, load_in_4bit=True) == {
        "max_seq_length": 8192,
        "load_in_4bit": True,
    }
    config = art.dev.get_model_config(
        "m", "out", art.dev.InternalModelConfig(init_args={"max_seq_length": 64})
    )
    assert config["init_args"]["max_seq_length"] == 64 and config["peft_args"]["r"] == 8


def test_internal_config_maps_what_artery_has_and_notes_the_rest_once(noted):
    settings = art.dev.model_settings(T4_CONFIG)
    assert settings.trainer_env == {"ARTERY_TRAINER_MAX_SEQ_LEN": "512"}
    assert settings.lora == {"rank": 4, "alpha": 8}
    assert settings.train_defaults == {"max_grad_norm": 0.5}
    assert set(noted()) == {
        "engine_args.enforce_eager",
        "engine_args.gpu_memory_utilization",
        "engine_args.num_scheduler_steps",
        "peft_args.random_state",
        "trainer_args.optim",
        "tinker_args",
    }
    art.dev.model_settings(T4_CONFIG)  # a second model with the same settings: nothing said again
    assert len(noted()) == 6
    # Never refused, even a key ART does not have; a value that cannot be right is.
    art.dev.model_settings({"no_such_key": 1, "engine_args": {"max_lora_rank": 32, "dtype": "bfloat16"}})
    assert "no_such_key" in noted()
    with pytest.raises(ValueError, match="max_seq_length"):
        art.dev.model_settings({"init_args": {"max_seq_length": 0}})


def test_internal_config_set_after_construction_takes_effect(noted):
    model = art.TrainableModel(name="late", project="surface", base_model=TINY)
    assert model.lora_config is None and model._internal_config is None
    model._internal_config = art.dev.InternalModelConfig(  # as ART's 2048 example does
        peft_args={"r": 2}, chat_template_kwargs={"enable_thinking": False}, init_args={"max_seq_length": 256}
    )
    assert model.lora_config == {"rank": 2}
    assert model.chat_template_kwargs == {"enable_thinking": False}
    assert model.model_dump()["_internal_config"]["peft_args"] == {"r": 2}

    class NotStarted:  # what register() reads of a LocalBackend whose stack has not started
        _started = False

        def __init__(self):
            self.stack = type("Stack", (), {"extra_env": {}, "processes": {}})()
            self.inference_env: dict[str, str] = {}

    backend = NotStarted()
    apply_model_settings(backend, model, model._settings)
    assert backend.stack.extra_env == {"ARTERY_TRAINER_MAX_SEQ_LEN": "256"}
    # A backend joining services that run on their own: the setting is named, not silently dropped.
    apply_model_settings(object(), model, model._settings)
    assert "ARTERY_TRAINER_MAX_SEQ_LEN=256" in noted()


def test_local_backend_in_process_is_accepted_with_a_note(noted, tmp_path):
    backend = LocalBackend(in_process=True, path=tmp_path / "stack-home")
    assert noted() == ["LocalBackend(in_process=True)"]
    assert not backend.stack.processes  # nothing started by construction, as before


async def test_a_base_model_that_cannot_be_had_fails_at_register_before_anything_starts(tmp_path):
    backend = LocalBackend(path=tmp_path / "art")
    model = art.TrainableModel(name="qwen", project="surface", base_model="Qwen/Qwen2.5-7B-Instruct")
    started = time.monotonic()
    try:
        with pytest.raises(BaseModelUnavailable) as caught:
            await model.register(backend)
        message = str(caught.value)
        assert "Qwen/Qwen2.5-7B-Instruct" in message
        for way in ("local directory", "Hugging Face cache", "SmolLM2-135M-Instruct", TINY):
            assert way in message
        assert time.monotonic() - started < 5
        assert not backend._started and not backend.stack.processes
    finally:
        await backend.close()
    # What can be had passes: a directory with a model, an embedded name.
    from artery.shared.tiny_model import tiny_model_path
    from artery.utils.base_model import check_base_model

    check_base_model(str(tiny_model_path()))
    check_base_model("smollm2")
    with pytest.raises(BaseModelUnavailable, match="neither a model"):
        check_base_model(str(tmp_path))


async def test_track_duration_takes_arts_keyword():
    trajectory = art.Trajectory(reward=1.0)
    async with trajectory.track_duration(metric_name="tool"):
        pass
    async with trajectory.track_duration("tool"):
        pass
    assert trajectory.metrics["tool_duration"] >= 0.0 and list(trajectory.metrics) == ["tool_duration"]


def test_train_config_beta_is_arts_older_name_for_the_kl_coefficient():
    config = art.TrainConfig(learning_rate=1e-5, beta=0.04)
    assert config.kl_penalty_coef == 0.04
    assert art.TrainConfig().kl_penalty_coef == 0.0
    with pytest.raises(ValueError, match="give one"):
        art.TrainConfig(beta=0.1, kl_penalty_coef=0.2)
    import msgspec

    wire = msgspec.json.decode(msgspec.json.encode(config), type=TrainConfig)
    assert wire.kl_penalty_coef == 0.04  # what the trainer reads


async def test_gather_accepts_pbar_total_completion_tokens(noted):
    async def rollout(reward: float) -> art.Trajectory:
        return art.Trajectory(messages_and_choices=[{"role": "user", "content": "q"}], reward=reward)

    groups = await art.gather_trajectory_groups(
        [art.TrajectoryGroup(rollout(r) for r in (0.0, 1.0))], pbar_total_completion_tokens=True
    )
    loose = await art.gather_trajectories([rollout(0.5)], pbar_total_completion_tokens=True)
    assert [t.reward for t in groups[0]] == [0.0, 1.0] and [t.reward for t in loose] == [0.5]
    assert noted() == ["pbar_total_completion_tokens=True"]


async def test_register_takes_arts_openai_client_config(noted):
    class Registry:  # a backend joining a running Artery (what register() uses of one)
        inference_api_key = None

        async def register(self, model):
            self.registered = model

        async def _inference_url(self, model):
            return "http://127.0.0.1:9/v1"

    backend = Registry()
    model = art.TrainableModel(name="served", project="surface", base_model=TINY)
    await model.register(
        backend,
        _openai_client_config=art.dev.OpenAIServerConfig(
            server_args=art.dev.ServerArgs(port=8000), engine_args=art.dev.EngineArgs(max_lora_rank=32)
        ),
    )
    assert backend.registered is model and model.inference_base_url == "http://127.0.0.1:9/v1"
    assert set(noted()) == {"_openai_client_config.server_args", "ARTERY_INFERENCE_MAX_LORA_RANK=32"}


def test_pydantic_methods_on_models_and_trajectories():
    model = art.TrainableModel(name="a", project="surface", base_model=TINY, config={"turns": [1, 2]})
    copy = model.model_copy(deep=True)  # ART's art-e example: copy, rename, change the config
    copy.name = "b"
    copy.config["turns"].append(3)
    assert (model.name, model.config) == ("a", {"turns": [1, 2]})
    assert copy.model_dump()["name"] == "b" and copy.model_dump()["base_model"] == TINY
    assert json.loads(model.model_dump_json())["config"] == {"turns": [1, 2]}
    assert model.model_copy(update={"name": "c"}).name == "c"
    import pydantic

    class Policy(pydantic.BaseModel):  # ART's art-e example: a pydantic config, copied per run
        max_turns: int = 10

    agent = art.TrainableModel(name="e", project="surface", base_model=TINY, config=Policy())
    longer = agent.model_copy(deep=True)
    longer.config.max_turns = 30
    assert agent.config.max_turns == 10 and longer.model_dump()["config"] == {"max_turns": 30}
    from artery.utils.model_files import jsonable

    assert jsonable(longer.config) == {"max_turns": 30}  # what the registry record holds

    from openai.types.chat.chat_completion import Choice

    choice = Choice.model_validate(
        {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "4"}}
    )
    trajectory = art.Trajectory(
        messages_and_choices=[{"role": "user", "content": "2+2?"}, choice], reward=1.0, metrics={"turns": 1}
    )
    logged = trajectory.for_logging()
    assert [m["trainable"] for m in logged["messages"]] == [False, True]
    assert logged["messages"][1]["content"] == "4" and logged["reward"] == 1.0
    dumped = trajectory.model_dump(mode="json")
    assert dumped["messages_and_choices"][1]["message"]["content"] == "4" and "start_time" not in dumped
    assert json.dumps(dumped)
    group = art.TrajectoryGroup([trajectory], metadata={"task": "sum"})
    other = group.model_copy(deep=True)
    other.trajectories[0].reward = 0.0
    assert group.trajectories[0].reward == 1.0
    assert group.model_dump()["metadata"] == {"task": "sum"}
    assert other.to_event(project="p", model="m").id != group.to_event(project="p", model="m").id


def test_model_state_lives_in_state_json_in_the_model_directory(tmp_path):
    model = art.TrainableModel(name="stateful", project="surface", base_model=TINY, base_path=str(tmp_path))
    assert model.read_state() is None
    model.overwrite_state({"epoch": 1, "seen": ["a"]})
    assert model.merge_state({"epoch": 2}) == {"epoch": 2, "seen": ["a"]}
    path = tmp_path / "surface" / "models" / "stateful" / "state.json"
    assert json.loads(path.read_text()) == {"epoch": 2, "seen": ["a"]} == model.read_state()
    with pytest.raises(TypeError):
        model.overwrite_state({"bad": object()})
    assert model.read_state() == {"epoch": 2, "seen": ["a"]}  # a refused state leaves the old one


async def test_backend_is_a_method_as_in_art():
    model = art.Model(name="m", project="surface")
    with pytest.raises(RuntimeError, match="not registered"):
        model.backend()

    class Backend:
        async def register(self, model):
            pass

    backend = Backend()
    await model.register(backend)
    assert model.backend() is backend


def test_model_files_go_under_arts_dot_art_by_default(tmp_path):
    assert art.TrainableModel(name="m", project="p", base_model=TINY).directory == Path(".art/p/models/m")
    assert LocalBackend().models_path == Path(".art")  # model files; the stack stays under .artery
    given = LocalBackend(path=tmp_path)
    assert given.models_path == tmp_path == given.path


def test_best_step_is_read_from_history_as_art_does(tmp_path):
    history = tmp_path / "history.jsonl"
    rows = [
        {"step": 1, "val/reward": 0.2},
        {"step": 1, "train/loss": 0.5},
        {"step": 2, "val/reward": 0.9},
        {"step": 2, "val/reward": 0.3},  # two rows for one step: their mean, 0.6
        {"step": 3, "val/reward": 0.7},
        {"step": 4, "val/reward": float("nan")},
    ]
    history.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert best_step_in_history(history, "val/reward") == 3
    assert best_step_in_history(history, "train/loss") == 1
    assert best_step_in_history(history, "val/missing") is None
    assert best_step_in_history(tmp_path / "none.jsonl", "val/reward") is None


async def test_a_trajectory_without_a_reward_is_refused_not_trained_as_zero():
    unrewarded = art.Trajectory(messages_and_choices=[{"role": "user", "content": "q"}])
    assert unrewarded.reward == 0.0  # reads as ART 0.5's default...
    groups = [art.TrajectoryGroup([art.Trajectory(reward=1.0), unrewarded])]
    backend = art.Backend(nats_url="nats://127.0.0.1:1")  # never reached: refused first
    model = art.TrainableModel(name="m", project="surface", base_model=TINY)
    model._backend = backend
    with pytest.raises(ValueError, match=r"trajectories \[1\] have no reward"):
        await backend.train(model, groups)
    with pytest.raises(ValueError, match="no reward"):
        await model.log(groups, split="val", step=0)
    assert unrewarded.model_dump()["reward"] is None
    # A group the reward service scores (RULER) needs no reward of the agent's.
    judged = art.TrajectoryGroup([unrewarded], reward=art.RewardSpec(ruler=art.RulerSpec(judge_model="j")))
    from artery.trajectories import require_rewards

    require_rewards([judged])
    combined = art.RewardSpec(ruler=art.RulerSpec(judge_model="j", combine_with_reward=True))
    with pytest.raises(ValueError, match="no reward"):  # the judge's score is added to the agent's
        require_rewards([art.TrajectoryGroup([unrewarded], reward=combined)])


async def test_ruler_debug_prints_the_judges_prompt_and_scores(capsys):
    from artery.rewards import ruler, ruler_score_group

    convo = [{"role": "user", "content": "2+2?"}]
    group = art.TrajectoryGroup(
        [
            art.Trajectory(messages_and_choices=[*convo, {"role": "assistant", "content": a}], reward=0.0)
            for a in ("4", "5")
        ]
    )
    with serve_scripted_judge() as judge:
        judge.answers = [scores_json(("1", 0.9), ("2", 0.1)), scores_json(("1", 0.8), ("2", 0.2))]
        scored = await ruler_score_group(group, "openai/judge", judge.params(), debug=True)
        out = capsys.readouterr().out
        assert "[RULER] judge prompt" in out and "2+2?" in out and "0.9" in out
        assert [t.reward for t in scored] == [0.9, 0.1]
        scores = await ruler([t.messages() for t in group], "openai/judge", judge.params(), debug=True)
        assert [s.score for s in scores] == [0.8, 0.2] and "[RULER] scores" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_an_art_program_keeps_its_best_val_step_and_its_engine_settings(tmp_path, noted):
    """ART's temporal-clue shape on the real services: the model's settings set after construction,
    ``in_process=True``, ``model.log(val)`` each step, then ``delete_checkpoints("val/reward")``."""
    backend = LocalBackend(in_process=True, path=tmp_path / "art")
    # ART keeps every step until delete_checkpoints(); Artery's publisher also retains on its own
    # after each step (the latest and the best reward_mean): here it keeps them all, as ART does.
    backend.stack.extra_env["ARTERY_PUBLISHER_KEEP_LATEST"] = "100"
    model = art.TrainableModel(name="clue", project="surface", base_model=TINY)
    model._internal_config = art.dev.InternalModelConfig(
        init_args=art.dev.InitArgs(max_seq_length=512), engine_args=art.dev.EngineArgs(enforce_eager=True)
    )

    async def rollout(model: art.TrainableModel, i: int) -> art.Trajectory:
        messages: art.Messages = [{"role": "user", "content": f"say {i}"}]
        completion = await model.openai_client().chat.completions.create(
            model=model.name, messages=messages, max_tokens=4, logprobs=True
        )
        choice = completion.choices[0]
        return art.Trajectory(messages_and_choices=[*messages, choice], reward=float(i % 2))

    def val_group(reward: float) -> art.TrajectoryGroup:
        return art.TrajectoryGroup(
            [art.Trajectory(messages_and_choices=[{"role": "user", "content": "v"}], reward=reward)]
        )

    try:
        await model.register(backend)
        assert backend.stack.processes["trainer"].env["ARTERY_TRAINER_MAX_SEQ_LEN"] == "512"
        assert model.backend() is backend
        for val_reward in (0.2, 0.9, 0.5):  # val/reward by step: the best is step 1
            await model.log([val_group(val_reward)], split="val")
            groups = await art.gather_trajectory_groups(
                [art.TrajectoryGroup(rollout(model, i) for i in range(4))], pbar_total_completion_tokens=True
            )
            await model.train(groups, config=art.TrainConfig(learning_rate=1e-3, beta=0.0))
        assert await model.get_step() == 3
        history = tmp_path / "art" / "surface" / "models" / "clue" / "history.jsonl"
        assert best_step_in_history(history, "val/reward") == 1
        applied = await model.delete_checkpoints("val/reward")
        assert applied.best_step == 1
        assert applied.kept == [1, 3] and 2 in applied.deleted
        assert {"LocalBackend(in_process=True)", "engine_args.enforce_eager"} <= set(noted())
    finally:
        await backend.close()
