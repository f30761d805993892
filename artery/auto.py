"""AutoRL: train a model on a task from its description alone (ART's ``auto_rl`` notebook, as one call).

From a task description an LLM generates the training inputs (and a system prompt); each input is
rolled out ``rollouts_per_group`` times against the model's own endpoint; RULER scores each group
relative to itself (in the agent's process, or by the reward service); ``model.train`` takes a
step per batch. The generated inputs are stored with the run, as JSON under the model's directory
(``<path>/<project>/models/<name>/auto_rl_inputs.json``), so a second run with the same task
replays them instead of asking the generator again.

    import artery as art
    from artery.auto import auto_rl

    result = await auto_rl(
        model, "Rewrite the user's text in formal business English.",
        num_training_inputs=16, generator_model="openai/gpt-4.1-mini", judge_model="openai/o4-mini",
    )

:func:`generate_json` (``artery.generation``, shared with ``artery.mcp``'s ``generate_scenarios``)
asks any litellm model (or an OpenAI-compatible ``base_url``) for JSON of a schema, checks the
answer, asks once again on a bad one, then raises :class:`GenerationError`.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from artery.generation import DEFAULT_GENERATOR_MODEL, counted_list, excerpt, generate_json
from artery.generation import GenerationError as GenerationError  # where AutoRL's callers import it
from artery.rewards.ruler import DEFAULT_RUBRIC, ruler_score_group
from artery.schemas import RewardSpec, RulerSpec, TrainConfig
from artery.trajectories import Trajectory, TrajectoryGroup

#: Where the generated inputs of a run are kept, under ``model.directory``.
INPUTS_FILE = "auto_rl_inputs.json"


# ---------------------------------------------------------------- training inputs and system prompt


def _inputs_schema(n: int) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "inputs": {"type": "array", "items": {"type": "string"}, "minItems": n, "maxItems": n}
        },
        "required": ["inputs"],
        "additionalProperties": False,
    }


async def generate_training_inputs(
    task_description: str,
    num_examples: int = 25,
    *,
    generator_model: str = DEFAULT_GENERATOR_MODEL,
    generator_api_key: str | None = None,
    generator_base_url: str | None = None,
    extra_litellm_params: dict[str, Any] | None = None,
) -> list[str]:
    """``num_examples`` diverse inputs someone might give a model doing ``task_description``."""
    if num_examples < 1:
        raise ValueError("num_examples must be at least 1")

    def check(answer: Any) -> list[str]:
        inputs = counted_list(answer, "inputs", num_examples, "<string>")
        bad = [i for i, s in enumerate(inputs) if not isinstance(s, str) or not s.strip()]
        if bad:
            raise ValueError(f"inputs {bad[:5]} are not non-empty strings")
        return [s.strip() for s in inputs]

    system = (
        "You are a helpful assistant that generates diverse, high-quality training inputs.\n\n"
        f"Task: {task_description}\n\n"
        f"Generate {num_examples} diverse INPUT examples that someone might provide for this task. "
        "Make sure the inputs:\n1. Cover a wide range of cases and edge cases\n2. Are realistic and "
        "practical\n3. Vary in length and complexity\n4. Represent real-world scenarios\n\n"
        "Only generate the INPUTS, not the outputs: an LLM judge will evaluate the model's attempts."
    )
    user = (
        f"Generate {num_examples} input examples for the task described above. Respond with a JSON "
        f'object {{"inputs": [...]}} holding exactly {num_examples} strings.'
    )
    return await generate_json(
        [{"role": "system", "content": system}, {"role": "user", "content": user}],
        _inputs_schema(num_examples),
        check,
        schema_name="training_inputs",
        generator_model=generator_model,
        generator_api_key=generator_api_key,
        generator_base_url=generator_base_url,
        extra_litellm_params=extra_litellm_params,
        what=f"list of {num_examples} training inputs",
    )


SYSTEM_PROMPT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"system_prompt": {"type": "string"}},
    "required": ["system_prompt"],
    "additionalProperties": False,
}


async def generate_system_prompt(
    task_description: str,
    *,
    generator_model: str = DEFAULT_GENERATOR_MODEL,
    generator_api_key: str | None = None,
    generator_base_url: str | None = None,
    extra_litellm_params: dict[str, Any] | None = None,
) -> str:
    """A clear, direct system prompt for a model doing ``task_description``."""

    def check(answer: Any) -> str:
        prompt = answer.get("system_prompt") if isinstance(answer, dict) else None
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError('expected an object {"system_prompt": "<non-empty string>"}')
        return prompt.strip()

    messages = [
        {
            "role": "system",
            "content": "Generate a clear, concise system prompt for a model that will perform the "
            "following task. The prompt should be direct and instructional.",
        },
        {
            "role": "user",
            "content": f"Task: {task_description}\n\nGenerate a system prompt for this task. Respond "
            'with a JSON object {"system_prompt": "..."}.',
        },
    ]
    return await generate_json(
        messages,
        SYSTEM_PROMPT_SCHEMA,
        check,
        schema_name="system_prompt",
        generator_model=generator_model,
        generator_api_key=generator_api_key,
        generator_base_url=generator_base_url,
        extra_litellm_params=extra_litellm_params,
        max_completion_tokens=2000,
        what="system prompt",
    )


@dataclass
class AutoRLInputs:
    """What a run trained on, stored as JSON with the run so that it can be replayed."""

    task_description: str
    system_prompt: str
    inputs: list[str]
    generator_model: str
    created_at: float = field(default_factory=time.time)

    def save(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2, ensure_ascii=False))
        tmp.replace(path)  # atomically: a crash never leaves half a file to replay
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> AutoRLInputs:
        data = json.loads(Path(path).read_text())
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


# ---------------------------------------------------------------- the loop


@dataclass
class AutoRLResult:
    inputs: AutoRLInputs
    inputs_path: Path
    #: ``True`` when the inputs came from a stored file rather than the generator.
    replayed: bool
    #: One entry per training step: the step before and after, mean reward, trajectories.
    steps: list[dict[str, Any]]
    final_step: int
    judge_failures: int = 0


async def auto_rollout(
    model: Any,
    system_prompt: str,
    input_text: str,
    *,
    max_tokens: int = 256,
    temperature: float = 0.7,
) -> Trajectory:
    """One single-turn rollout of the task: system prompt, the input, the model's answer."""
    trajectory = Trajectory(
        messages_and_choices=[
            {"role": "system", "content": system_prompt},
            {"role": "user", "content": input_text},
        ],
        reward=0.0,  # RULER's score replaces it
        metadata={"input": input_text[:500]},
    )
    response = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(),
        messages=trajectory.messages(),
        max_tokens=max_tokens,
        temperature=temperature,
        logprobs=True,
    )
    trajectory.messages_and_choices.append(response.choices[0])  # token ids and logprobs kept
    return trajectory.finish()


async def auto_rl(
    model: Any,
    task_description: str,
    *,
    num_training_inputs: int = 16,
    groups_per_step: int = 2,
    rollouts_per_group: int = 4,
    num_epochs: int = 1,
    max_steps: int | None = None,
    learning_rate: float = 1e-5,
    train_config: TrainConfig | None = None,
    generator_model: str = DEFAULT_GENERATOR_MODEL,
    generator_api_key: str | None = None,
    generator_base_url: str | None = None,
    generator_params: dict[str, Any] | None = None,
    system_prompt: str | None = None,
    judge_model: str | None = "openai/o4-mini",
    judge_params: dict[str, Any] | None = None,
    ruler: Literal["agent", "service"] = "agent",
    rubric: str | None = None,
    max_tokens: int = 256,
    temperature: float = 0.7,
    inputs_path: str | os.PathLike | None = None,
    regenerate: bool = False,
    on_judge_failure: Literal["drop", "raise"] = "drop",
    log: Callable[[str], None] | None = print,
) -> AutoRLResult:
    """Generate inputs for ``task_description``, roll out, score with RULER, train; see the module doc.

    ``model`` is a registered ``art.TrainableModel``. The inputs (and the system prompt) are read
    from ``inputs_path`` (default: ``model.directory / "auto_rl_inputs.json"``) when it holds a
    run of the same task and ``regenerate`` is false; otherwise they are generated and written
    there before training starts. ``ruler="agent"`` scores each group in this process with
    ``judge_model`` and ``judge_params`` (litellm keywords: ``api_base``, ``api_key``...);
    ``ruler="service"`` asks the reward service (``RewardSpec(ruler=RulerSpec(judge_model=...))``),
    whose judge address is the deployment's. Training resumes from ``await model.get_step()``.
    """
    from artery.gather import gather_trajectory_groups
    from artery.utils.iterate_dataset import iterate_dataset

    say = log or (lambda _msg: None)
    path = Path(inputs_path) if inputs_path is not None else model.directory / INPUTS_FILE
    gen: dict[str, Any] = {  # the generator, as both helpers take it
        "generator_model": generator_model,
        "generator_api_key": generator_api_key,
        "generator_base_url": generator_base_url,
        "extra_litellm_params": generator_params,
    }
    stored: AutoRLInputs | None = None
    if path.exists() and not regenerate:
        stored = AutoRLInputs.load(path)
        if stored.task_description != task_description:
            raise ValueError(
                f"{path} holds the inputs of another task ({excerpt(stored.task_description, 80)!r}); "
                "pass regenerate=True or another inputs_path"
            )
    if stored is not None:
        inputs, replayed = stored, True
        say(f"replaying {len(inputs.inputs)} stored inputs from {path}")
    else:
        say(f"generating {num_training_inputs} training inputs with {generator_model}...")
        generated = await generate_training_inputs(task_description, num_training_inputs, **gen)
        prompt = system_prompt or await generate_system_prompt(task_description, **gen)
        inputs = AutoRLInputs(task_description, prompt, generated, generator_model)
        inputs.save(path)
        replayed = False
        say(f"stored {len(generated)} inputs in {path}")
    if system_prompt and system_prompt != inputs.system_prompt:
        inputs.system_prompt = system_prompt
        inputs.save(path)

    rubric = rubric or f"{DEFAULT_RUBRIC}\n- The task the agent was given: {task_description.strip()}"
    config = train_config or TrainConfig(learning_rate=learning_rate)
    spec = RewardSpec(ruler=RulerSpec(judge_model=judge_model, rubric=rubric)) if ruler == "service" else None
    judge_failures = 0

    async def score(group: TrajectoryGroup) -> TrajectoryGroup | None:
        nonlocal judge_failures
        if ruler == "service":
            return group
        try:
            return await ruler_score_group(
                group, judge_model or "openai/o4-mini", extra_litellm_params=judge_params, rubric=rubric
            )
        except Exception as exc:
            judge_failures += 1
            if on_judge_failure == "raise":
                raise
            say(f"the judge could not score a group (dropped): {excerpt(str(exc), 200)!r}")
            return None

    steps: list[dict[str, Any]] = []
    start = await model.get_step()
    for batch in iterate_dataset(
        inputs.inputs,
        groups_per_step=groups_per_step,
        num_epochs=num_epochs,
        initial_step=start,
        use_tqdm=False,
    ):
        if max_steps is not None and len(steps) >= max_steps:
            break
        groups = await gather_trajectory_groups(
            (
                TrajectoryGroup(
                    (
                        auto_rollout(
                            model, inputs.system_prompt, item, max_tokens=max_tokens, temperature=temperature
                        )
                        for _ in range(rollouts_per_group)
                    ),
                    reward=spec,
                    metadata={"input": item[:500]},
                )
                for item in batch.items
            ),
            pbar_desc=f"auto_rl step {batch.step}",
            max_exceptions=rollouts_per_group * len(batch.items) // 4,
            after_each=score,
        )
        groups = [g for g in groups if len(g)]
        if not groups:
            say(f"step {batch.step}: every group was dropped; nothing to train")
            continue
        result = await model.train(groups, config=config)
        trajectories = [t for g in groups for t in g]
        point = {
            "step": batch.step,
            "new_step": result.step,
            "epoch": batch.epoch,
            "groups": len(groups),
            "trajectories": len(trajectories),
            # With the service judge the agent-side rewards are placeholders; the trainer's are the judge's.
            "reward": result.metrics.get("reward_mean", statistics.fmean(t.reward for t in trajectories)),
            "loss": result.metrics.get("loss"),
        }
        steps.append(point)
        say(f"step {result.step}: reward {point['reward']:.3f} over {len(trajectories)} trajectories")
    return AutoRLResult(
        inputs=inputs,
        inputs_path=path,
        replayed=replayed,
        steps=steps,
        final_step=await model.get_step(),
        judge_failures=judge_failures,
    )
