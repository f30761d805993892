"""ART's idioms, run as ART users write them: small programs that ``import artery as art`` and use
what ART's examples use (``art.dev`` configs set after construction, ``_internal_config`` as a
dict, S3 push and pull around the training loop, ``ruler_score_group(..., debug=True)`` through
``gather_trajectory_groups(after_each=...)``, ``LocalBackend(in_process=True)``), and omit what
ART's examples omit (``logprobs=True`` in their completions, ``backend.close()``).

Each program runs in a process of its own on the tiny model, against real servers (the embedded
stack it starts, moto's S3 server, a scripted judge over HTTP). Each must exit 0, take a real
gradient step wherever its rewards varied (the history ``model.train`` wrote says how many tokens
were trained), and leave no process behind once it has exited.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from artery.testing.judge import serve_scripted_judge
from tests.example_helpers import scores_by_id
from tests.test_s3_transport import s3_server  # noqa: F401 - the fixture, used by name
from tests.test_stack_lifetime import GONE_WITHIN_S, PROBE, stack_processes, still_running

#: A program's whole run: its stack's start, a replica of the tiny model, rollouts and steps.
RUN_TIMEOUT_S = 600.0

#: What both programs share, as ART's examples have it: a task, a reward, a rollout that asks the
#: model's OpenAI client for a completion without logprobs and keeps the choice.
ROLLOUT = """
import asyncio
import random

import artery as art
from artery.shared.models import TINY

random.seed(42)


def first_half_share(text: str) -> float:
    letters = [c for c in text.lower() if c.isalpha()]
    return sum(c <= "m" for c in letters) / len(letters) if letters else 0.0


async def rollout(model: art.Model, step: int, scored: bool = True) -> art.Trajectory:
    messages: art.Messages = [
        {"role": "system", "content": "Answer with letters from the first half of the alphabet."},
        {"role": "user", "content": f"Round {step}: write a short word."},
    ]
    client = model.openai_client()
    chat_completion = await client.chat.completions.create(
        messages=messages, model=model.get_inference_name(), max_tokens=8
    )
    choice = chat_completion.choices[0]
    content = choice.message.content
    assert isinstance(content, str)
    trajectory = art.Trajectory(messages_and_choices=[*messages, choice], metrics={"length": len(content)})
    if scored:
        trajectory.reward = first_half_share(content)
    return trajectory
"""

#: 2048's and temporal-clue's shape: dev configs set after construction, pull before register,
#: delete_checkpoints and a push each step, ART's older keywords, no close().
S3_LOOP = """
model = art.TrainableModel(name="001", project="conformance-s3", base_model=TINY)
model._internal_config = art.dev.InternalModelConfig(
    init_args=art.dev.InitArgs(max_seq_length=1024),
    engine_args=art.dev.EngineArgs(enforce_eager=True, gpu_memory_utilization=0.8, num_scheduler_steps=1),
)


async def main():
    from artery.local import LocalBackend

    backend = LocalBackend()
    await backend._experimental_pull_from_s3(model, verbose=True)
    await model.register(backend)

    for i in range(await model.get_step(), STEPS):
        val_groups, train_groups = await asyncio.gather(
            art.gather_trajectory_groups(
                (art.TrajectoryGroup(rollout(model, i) for _ in range(2)) for _ in range(1)),
                pbar_desc="val",
            ),
            art.gather_trajectory_groups(
                (art.TrajectoryGroup(rollout(model, i) for _ in range(6)) for _ in range(2)),
                pbar_desc="gather",
                max_exceptions=10,
            ),
        )
        await model.log(val_groups)
        await model.delete_checkpoints()
        await model.train(
            train_groups,
            config=art.TrainConfig(learning_rate=1e-2),
            _config={"logprob_calculation_chunk_size": 8},
        )
        await backend._experimental_push_to_s3(model)


if __name__ == "__main__":
    asyncio.run(main())
"""

#: The RULER notebooks' shape: in_process=True, _internal_config as a dict, rollouts without a
#: reward, the judge scoring each group as it finishes (debug=True), no close().
RULER_LOOP = """
from artery.local import LocalBackend
from artery.rewards import ruler_score_group


async def main():
    backend = LocalBackend(in_process=True, path="./.art")
    model = art.TrainableModel(
        name="agent-001",
        project="conformance-ruler",
        base_model=TINY,
        _internal_config={"init_args": {"gpu_memory_utilization": 0.775}},
    )
    await model.register(backend)

    for i in range(await model.get_step(), 1):
        groups = await art.gather_trajectory_groups(
            (art.TrajectoryGroup(rollout(model, i, scored=False) for _ in range(4)) for _ in range(2)),
            pbar_desc="gather",
            after_each=lambda group: ruler_score_group(
                group, "openai/o4-mini", debug=True, swallow_exceptions=True
            ),
            max_exceptions=2,
        )
        await model.train(groups, config=art.TrainConfig(learning_rate=1e-2))


if __name__ == "__main__":
    asyncio.run(main())
"""


def run_program(directory: Path, source: str, env: dict[str, str]) -> tuple[str, dict]:
    """Run ``source`` in ``directory`` until it exits; return what it printed, and every process
    its stack had while it ran (for the check that none outlives it)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "program.py").write_text(source)
    tag = uuid.uuid4().hex
    output = directory / "output.log"
    with open(output, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "program.py"],
            cwd=directory,
            env={**os.environ, **env, PROBE: tag},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        seen: dict[tuple[int, int], str] = {}
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while True:  # note the stack's processes as they come, until the program ends
            seen.update(stack_processes(proc.pid, tag))
            try:
                proc.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                if time.monotonic() > deadline:
                    proc.kill()
                    raise AssertionError(
                        f"{directory.name} ran past {RUN_TIMEOUT_S}s:\n{output.read_text()}"
                    ) from None
    said = output.read_text(errors="replace")
    assert proc.returncode == 0, f"{directory.name} exited {proc.returncode}:\n{said[-6000:]}"
    assert len(seen) > 3, f"the program's stack was never seen ({seen})"
    return said, seen


def assert_nothing_left(program: str, seen: dict) -> None:
    deadline = time.monotonic() + GONE_WITHIN_S
    while (left := still_running(seen)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"{program} exited without close(); its processes outlived it: {left}"


def history(directory: Path, project: str, name: str) -> list[dict]:
    path = directory / ".art" / project / "models" / name / "history.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def trained_rows(rows: list[dict]) -> list[dict]:
    return [r for r in rows if "train/tokens_trained" in r]


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_art_s3_loop_trains_pushes_and_a_new_machine_continues_from_the_bucket(tmp_path, s3_server):  # noqa: F811
    source = textwrap.dedent(ROLLOUT) + textwrap.dedent(S3_LOOP)
    _, first_seen = run_program(tmp_path / "first", f"STEPS = 1\n{source}", {})
    assert_nothing_left("the first run", first_seen)
    (row,) = trained_rows(history(tmp_path / "first", "conformance-s3", "001"))
    assert row["step"] == 1

    # Another machine (a new directory, a new stack): the pull brings step 1 and its history.
    second_said, second_seen = run_program(tmp_path / "second", f"STEPS = 2\n{source}", {})
    assert_nothing_left("the second run", second_seen)
    assert "continues from pulled step 1" in second_said
    rows = trained_rows(history(tmp_path / "second", "conformance-s3", "001"))
    assert [r["step"] for r in rows] == [1, 2]  # the pulled history, then its own step
    assert rows[0] == row
    # Wherever rewards varied, a real gradient step (random tiny-model answers vary nearly always).
    varied = [r for r in rows if r["train/reward_std_dev"] > 0]
    assert varied, rows
    assert all(r["train/tokens_trained"] > 0 for r in varied), rows
    assert "val/reward" in history(tmp_path / "second", "conformance-s3", "001")[-2]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_art_ruler_notebook_scores_with_debug_and_trains(tmp_path):
    source = textwrap.dedent(ROLLOUT) + textwrap.dedent(RULER_LOOP)
    with serve_scripted_judge() as judge:
        judge.answers = [scores_by_id]  # trajectory i of n scores i / n: rewards vary
        env = {"OPENAI_API_BASE": judge.api_base, "OPENAI_BASE_URL": judge.api_base, "OPENAI_API_KEY": "x"}
        said, seen = run_program(tmp_path / "ruler", source, env)
    assert_nothing_left("the RULER program", seen)
    assert len(judge.requests) == 2 and all(r["model"] == "o4-mini" for r in judge.requests)
    assert "why 1" in said  # debug=True printed the judge's explanations
    (row,) = trained_rows(history(tmp_path / "ruler", "conformance-ruler", "agent-001"))
    assert row["step"] == 1 and row["train/reward_std_dev"] > 0
    assert row["train/tokens_trained"] > 0, row
