"""AutoRL (``artery.auto``): inputs and a system prompt generated from a task description against a
scripted OpenAI-compatible server (count checked, one re-ask, then a clear error), stored with the
run and replayed, and ``examples/auto_rl`` training 2 steps end to end on the embedded stack with
RULER scoring each group."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from artery.auto import (
    INPUTS_FILE,
    AutoRLInputs,
    GenerationError,
    auto_rl,
    generate_system_prompt,
    generate_training_inputs,
)
from artery.testing.judge import serve_scripted_judge
from tests.example_helpers import completion, history, load_example, scores_by_id, script_help, scripted_llms

ROOT = Path(__file__).resolve().parent.parent
TASK = "Rewrite the user's text in formal business English."


example = load_example("auto_rl")


def inputs_json(n: int) -> str:
    return json.dumps({"inputs": [f"hey can u send report {i} asap" for i in range(n)]})


def answer(body: dict) -> str:
    """The generator's inputs or system prompt, or the judge's scores (trajectory ``i`` of ``n``: ``i/n``)."""
    name = body["response_format"]["json_schema"]["name"]
    if name == "training_inputs":
        return inputs_json(
            body["response_format"]["json_schema"]["schema"]["properties"]["inputs"]["minItems"]
        )
    if name == "system_prompt":
        return json.dumps({"system_prompt": "Rewrite the text formally."})
    return scores_by_id(body)


# ---------------------------------------------------------------- generation


async def test_inputs_and_system_prompt_are_generated_with_a_json_schema():
    with serve_scripted_judge() as server:
        server.answers = [answer]
        inputs = await generate_training_inputs(
            TASK, 4, generator_model="openai/generator", generator_base_url=server.api_base
        )
        prompt = await generate_system_prompt(
            TASK, generator_model="openai/generator", generator_base_url=server.api_base
        )
    assert inputs == [f"hey can u send report {i} asap" for i in range(4)]
    assert prompt == "Rewrite the text formally."
    first = server.requests[0]
    assert first["model"] == "generator" and TASK in first["messages"][0]["content"]
    items = first["response_format"]["json_schema"]["schema"]["properties"]["inputs"]
    assert items["minItems"] == items["maxItems"] == 4


async def test_a_bad_answer_is_asked_again_once_then_a_clear_error():
    with serve_scripted_judge() as server:
        server.answers = [inputs_json(2), inputs_json(3)]
        assert (
            len(
                await generate_training_inputs(
                    TASK, 3, generator_model="openai/g", generator_base_url=server.api_base
                )
            )
            == 3
        )
        assert "expected exactly 3 inputs, got 2" in server.requests[1]["messages"][-1]["content"]
        server.requests.clear()
        server.answers = [json.dumps({"inputs": ["ok", ""]}), json.dumps({"system_prompt": ""})]
        with pytest.raises(
            GenerationError, match=r"openai/g gave no usable list of 2 training inputs after 2"
        ):
            await generate_training_inputs(
                TASK, 2, generator_model="openai/g", generator_base_url=server.api_base
            )
        assert (
            len(server.requests) == 2
            and "not non-empty strings" in server.requests[1]["messages"][-1]["content"]
        )


# ---------------------------------------------------------------- the loop, stored inputs and replay


class FakeModel:
    """What ``auto_rl`` uses of a registered ``TrainableModel``: completions, ``train``, the step."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.step = 0
        self.trained: list[list] = []
        self.requests: list[dict] = []

        async def create(**request):
            self.requests.append(request)
            return completion({"content": f"answer {len(self.requests)}"})

        self.client = SimpleNamespace(chat=SimpleNamespace(completions=SimpleNamespace(create=create)))

    def openai_client(self):
        return self.client

    def get_inference_name(self):
        return "agent"

    async def get_step(self):
        return self.step

    async def train(self, groups, config=None):
        self.trained.append(groups)
        self.step += 1
        rewards = [t.reward for g in groups for t in g]
        return SimpleNamespace(
            step=self.step, metrics={"reward_mean": sum(rewards) / len(rewards), "loss": 0.1}
        )


async def test_auto_rl_stores_the_inputs_and_replays_them(tmp_path):
    model = FakeModel(tmp_path / "model")
    with serve_scripted_judge() as server:
        server.answers = [answer]
        kw = {
            "num_training_inputs": 4,
            "groups_per_step": 2,
            "rollouts_per_group": 3,
            "generator_model": "openai/generator",
            "generator_base_url": server.api_base,
            "judge_model": "openai/judge",
            "judge_params": {"api_base": server.api_base, "api_key": "x"},
            "log": None,
        }
        first = await auto_rl(model, TASK, **kw)
        generated = sum(b["model"] == "generator" for b in server.requests)
        assert generated == 2 and not first.replayed  # the inputs, then the system prompt
        assert first.inputs_path == tmp_path / "model" / INPUTS_FILE
        stored = json.loads(first.inputs_path.read_text())
        assert stored["task_description"] == TASK and len(stored["inputs"]) == 4
        assert stored["system_prompt"] == "Rewrite the text formally."
        assert [p["new_step"] for p in first.steps] == [1, 2] and first.final_step == 2
        # Each group was judged (2 groups a step), the rewards are the judge's: 1/3, 2/3, 1.
        assert sum(b["model"] == "judge" for b in server.requests) == 4
        for groups in model.trained:
            assert len(groups) == 2
            for group in groups:
                assert sorted(t.reward for t in group) == pytest.approx([1 / 3, 2 / 3, 1])
                assert group.trajectories[0].messages()[0] == {
                    "role": "system",
                    "content": stored["system_prompt"],
                }
                assert group.trajectories[0].messages()[1]["content"] in stored["inputs"]
                assert "independent_reward" in group.trajectories[0].metrics
        assert first.steps[0]["reward"] == pytest.approx(2 / 3)

        # A second epoch over the same task replays the file: the generator is not called again.
        server.requests.clear()
        second = await auto_rl(model, TASK, num_epochs=2, **kw)
        assert second.replayed and second.inputs.inputs == first.inputs.inputs
        assert not any(b["model"] == "generator" for b in server.requests)
        assert [p["new_step"] for p in second.steps] == [3, 4]  # resumed from step 2: epoch 2 only
        assert [p["epoch"] for p in second.steps] == [1, 1]

        with pytest.raises(ValueError, match="holds the inputs of another task"):
            await auto_rl(model, "Another task.", **kw)
        replaced = await auto_rl(model, "Another task.", regenerate=True, max_steps=0, **kw)
        assert (
            not replaced.replayed
            and AutoRLInputs.load(replaced.inputs_path).task_description == "Another task."
        )


def test_script_runs_standalone():
    out = script_help("auto_rl")
    assert "--task" in out and "--generator-model" in out and "--regenerate" in out


# ---------------------------------------------------------------- end to end on the embedded stack


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_auto_rl_example_trains_two_steps_on_ruler_scores(tmp_path):
    path = tmp_path / "artery"
    with serve_scripted_judge() as server:
        server.answers = [answer]
        summary = example.main(
            [
                "--task", TASK,
                "--num-inputs", "2",
                "--groups", "1",
                "--group-size", "3",
                "--max-tokens", "12",
                "--learning-rate", "1e-2",
                "--backend-path", str(path),
                *scripted_llms(server.api_base, "generator", "judge"),
            ]
        )  # fmt: skip
    assert summary["steps"] == 2 and summary["final_step"] == 2 and summary["judge_failures"] == 0
    assert [p["new_step"] for p in summary["curve"]] == [1, 2] and not summary["replayed"]
    stored = json.loads(Path(summary["inputs_path"]).read_text())
    assert Path(summary["inputs_path"]) == path / "examples" / "models" / "auto-rl-001" / INPUTS_FILE
    assert stored["task_description"] == TASK and len(stored["inputs"]) == 2
    assert sum(b["model"] == "judge" for b in server.requests) == 2  # one per group
    rows = {r["step"]: r for r in history(path, "auto-rl-001")}
    for point in summary["curve"]:
        row = rows[point["new_step"]]
        assert row["train/reward_mean"] == pytest.approx(2 / 3) and row["train/tokens_trained"] > 0
        assert row["train/ruler_score"] == pytest.approx(2 / 3)
