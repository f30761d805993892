"""The SDK's pure parts: trajectories, conversion, gathering, retry, metric summaries."""

from __future__ import annotations

import asyncio
import json

import pytest

import artery as art
from artery.convert import to_message
from artery.model import summarize


def test_choice_keeps_sampled_token_ids_and_logprobs():
    choice = {
        "index": 0,
        "finish_reason": "stop",
        "message": {"role": "assistant", "content": "42"},
        "logprobs": {
            "content": [
                {"token": "token_id:19", "logprob": -0.5, "top_logprobs": []},
                {"token": "token_id:7", "logprob": -1.25, "top_logprobs": []},
            ]
        },
    }
    message = to_message(choice)
    assert message.role == "assistant" and message.content == "42"
    assert message.sample.token_ids == [19, 7]
    assert message.sample.logprobs == [-0.5, -1.25]
    assert message.sample.finish_reason == "stop"
    assert message.trainable is True


def test_choice_with_explicit_token_ids_and_openai_objects():
    from openai.types.chat.chat_completion import Choice  # openai is optional for the SDK

    choice = Choice.model_validate(
        {
            "index": 0,
            "finish_reason": "tool_calls",
            "message": {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a":1}'}}
                ],
            },
            "logprobs": {"content": [{"token": "x", "logprob": -0.1, "top_logprobs": []}]},
            "token_ids": [5],
        }
    )
    message = to_message(choice)
    assert message.tool_calls[0].function.name == "add"
    assert message.sample.token_ids == [5]


def test_plain_messages_are_validated():
    assert to_message({"role": "user", "content": "hi"}).content == "hi"
    with pytest.raises(ValueError, match="not a chat message"):
        to_message({"role": "narrator", "content": "once upon a time"})


def test_trajectory_to_wire_and_messages():
    t = art.Trajectory(
        messages_and_choices=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "2+2?"},
            {"message": {"role": "assistant", "content": None}, "finish_reason": "stop"},
        ],
        reward=1.0,
        metrics={"correct": True},
    )
    t.log("checked")
    wire = t.to_wire()
    assert [m.role for m in wire.messages] == ["system", "user", "assistant"]
    assert wire.messages[2].content == "" and wire.messages[2].sample is None
    assert wire.logs == ["checked"] and wire.metrics == {"correct": True}
    assert t.messages()[2] == {"role": "assistant", "content": ""}


async def test_track_duration_accumulates():
    t = art.Trajectory()
    for _ in range(2):
        async with t.track_duration("tool"):
            await asyncio.sleep(0.01)
    assert t.metrics["tool_duration"] >= 0.02
    assert "duration" in t.finish().metrics


async def rollout(reward: float, fail: bool = False) -> art.Trajectory:
    await asyncio.sleep(0)
    if fail:
        raise RuntimeError("tool crashed")
    return art.Trajectory(messages_and_choices=[{"role": "user", "content": "x"}], reward=reward)


async def test_group_from_awaitables_captures_exceptions_within_limit():
    groups = await art.gather_trajectory_groups(
        [art.TrajectoryGroup(rollout(r, fail=(r == 0.5)) for r in (0.0, 0.5, 1.0)) for _ in range(2)],
        max_exceptions=2,
    )
    assert len(groups) == 2
    for g in groups:
        assert [t.reward for t in g] == [0.0, 1.0]
        assert g.exceptions[0].type == "RuntimeError" and "tool crashed" in g.exceptions[0].message


async def test_max_exceptions_exceeded_raises():
    with pytest.raises(art.TooManyExceptions):
        await art.gather_trajectory_groups(
            [art.TrajectoryGroup([rollout(1.0), rollout(0.0, fail=True)])], max_exceptions=0
        )


async def test_max_exceptions_as_fraction():
    # 1 failure of 4 rollouts is within 0.25 (floor(0.25 * 4) = 1) ...
    groups = await art.gather_trajectory_groups(
        [art.TrajectoryGroup([rollout(1), rollout(1), rollout(1), rollout(0, fail=True)])],
        max_exceptions=0.25,
    )
    assert len(groups[0]) == 3
    # ... 2 of 4 is not.
    with pytest.raises(art.TooManyExceptions):
        await art.gather_trajectory_groups(
            [art.TrajectoryGroup([rollout(1), rollout(1), rollout(0, fail=True), rollout(0, fail=True)])],
            max_exceptions=0.25,
        )


async def test_after_each_drops_and_flattens():
    async def after_each(group):
        if group.trajectories[0].reward == 0:
            return None
        return [group, group]

    groups = await art.gather_trajectory_groups(
        [art.TrajectoryGroup([rollout(r)]) for r in (0, 1)], after_each=after_each
    )
    assert len(groups) == 2 and all(g.trajectories[0].reward == 1 for g in groups)


async def test_gather_trajectories_filters_exceptions():
    result = await art.gather_trajectories([rollout(1), rollout(0, fail=True)], max_exceptions=1)
    assert [t.reward for t in result] == [1]


async def test_retry_async_and_sync():
    calls = []

    @art.retry(max_attempts=3, delay=0.001, exceptions=(ValueError,), on_retry=lambda e, n: calls.append(n))
    async def flaky():
        if len(calls) < 2:
            raise ValueError("again")
        return "ok"

    assert await flaky() == "ok" and calls == [1, 2]

    @art.retry(max_attempts=2, delay=0.001)
    def always():
        raise KeyError("no")

    with pytest.raises(KeyError):
        always()


def test_summarize_matches_art_averages():
    g1 = art.TrajectoryGroup([art.Trajectory(reward=0.0, metrics={"turns": 2}), art.Trajectory(reward=1.0)])
    g2 = art.TrajectoryGroup([art.Trajectory(reward=0.5)], exceptions=[RuntimeError("x")])
    out = summarize([g1, g2])
    assert out["reward"] == pytest.approx(0.5)
    assert out["turns"] == 2
    assert out["reward_std_dev"] == pytest.approx(0.5)  # pstdev of g1; g2 has one trajectory
    assert out["exception_rate"] == pytest.approx(0.25)


def test_model_names_are_checked():
    with pytest.raises(ValueError, match="not a valid name"):
        art.TrainableModel(name="my model", project="p", base_model="b")
    assert art.TrainableModel(name="my.model", project="p", base_model="b").name == "my.model"  # as ART
    with pytest.raises(TypeError):
        art.Model(name="m", project="p", config={"x": object()})
    assert art.Model(name="m", project="p").get_inference_name(3) == "m@3"
    json.dumps(art.Model(name="m", project="p", config={"a": 1}).config)


def test_group_from_a_generator_of_finished_trajectories_keeps_them():
    group = art.TrajectoryGroup(art.Trajectory(reward=r) for r in (0.0, 0.5, 1.0))
    assert [t.reward for t in group] == [0.0, 0.5, 1.0]


async def test_history_goes_under_the_local_backends_path_unless_set(tmp_path):
    from pathlib import Path

    class PathBackend:  # the two things register() uses of a LocalBackend
        path = Path(tmp_path / "runs")
        inference_api_key = None

        async def register(self, model):
            pass

        async def _inference_url(self, model):
            return "http://127.0.0.1:1/v1"

    model = art.TrainableModel(name="m", project="p", base_model="artery/tiny-random")
    assert model.directory == Path(".art/p/models/m")  # ART's default directory
    await model.register(PathBackend())
    assert model.directory == tmp_path / "runs" / "p" / "models" / "m"
    chosen = art.TrainableModel(name="m", project="p", base_model="x", base_path=str(tmp_path / "mine"))
    await chosen.register(PathBackend())
    assert chosen.directory == tmp_path / "mine" / "p" / "models" / "m"


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda t: setattr(t, "reward", float("nan")), "reward is nan"),
        (lambda t: t.metrics.update(latency=float("inf")), "metrics['latency'] is inf"),
        (lambda t: t.metadata.update(temperature=float("-inf")), "metadata['temperature'] is -inf"),
    ],
)
def test_a_group_with_a_non_finite_number_is_refused_before_it_is_published(change, named):
    """The collector would dead-letter it; the agent hears of it at once, with the field named."""
    good = art.Trajectory(messages_and_choices=[{"role": "user", "content": "hi"}], reward=1.0)
    bad = art.Trajectory(messages_and_choices=[{"role": "user", "content": "hi"}], reward=0.0)
    change(bad)
    group = art.TrajectoryGroup([good, bad])
    with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("]", r"\]")):
        group.to_event(project="p", model="m")
    assert art.TrajectoryGroup([good]).to_event(project="p", model="m").trajectories[0].reward == 1.0
