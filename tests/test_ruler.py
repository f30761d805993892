"""RULER: the pure parts (prompt format, score parsing) and the whole call against a real HTTP judge."""

from __future__ import annotations

import json

import pytest

import artery as art
from artery.rewards import DEFAULT_RUBRIC, RulerError, ruler, ruler_score_group
from artery.rewards.ruler import build_judge_messages, common_prefix_len, parse_scores
from artery.testing.judge import scores_json, serve_scripted_judge

SYSTEM = {"role": "system", "content": "You are an agent."}
USER = {"role": "user", "content": "What is 2+2?"}


def convo(answer: str) -> list[dict]:
    return [SYSTEM, USER, {"role": "assistant", "content": answer}]


# ---------------------------------------------------------------- pure parts


def test_common_prefix_len():
    assert common_prefix_len([]) == 0
    assert common_prefix_len([convo("4"), convo("5")]) == 2
    assert common_prefix_len([convo("4"), convo("4")]) == 3
    assert common_prefix_len([convo("4"), [SYSTEM]]) == 1
    assert common_prefix_len([convo("4"), [USER]]) == 0


def test_judge_messages_format():
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    messages = build_judge_messages([convo("4"), convo("5")], "be fair", tools)
    assert messages[0]["role"] == "system"
    assert messages[0]["content"].endswith("Grading standards:\nbe fair")
    assert "score between 0 and 1" in messages[0]["content"]
    expected = (
        "<context>\n"
        + json.dumps([SYSTEM, USER])
        + "\n</context>\n\n"
        + "<available_tools>\n"
        + json.dumps(tools)
        + "\n</available_tools>\n\n"
        + "Trajectories:\n\n"
        + '<trajectory id="1">\n'
        + json.dumps([{"role": "assistant", "content": "4"}])
        + "\n</trajectory>\n\n"
        + '<trajectory id="2">\n'
        + json.dumps([{"role": "assistant", "content": "5"}])
        + "\n</trajectory>"
    )
    assert messages[1] == {"role": "user", "content": expected}


def test_judge_messages_no_prefix_no_tools():
    a = [{"role": "user", "content": "a"}]
    b = [{"role": "user", "content": "b"}]
    user = build_judge_messages([a, b])[1]["content"]
    assert "<context>" not in user and "<available_tools>" not in user
    assert user.startswith('Trajectories:\n\n<trajectory id="1">\n' + json.dumps(a))


def test_judge_messages_identical_sends_one():
    user = build_judge_messages([convo("4"), convo("4"), convo("4")])[1]["content"]
    assert "<context>" not in user
    assert user == 'Trajectories:\n\n<trajectory id="1">\n' + json.dumps(convo("4")) + "\n</trajectory>"
    assert DEFAULT_RUBRIC.strip()


def test_parse_matches_by_id_not_position():
    scores = parse_scores(scores_json(("3", 0.1), ("1", 0.9), ("2", 0.5)), 3)
    assert [(s.trajectory_id, s.score, s.explanation) for s in scores] == [
        ("1", 0.9, "why 1"),
        ("2", 0.5, "why 2"),
        ("3", 0.1, "why 3"),
    ]


def test_parse_accepts_dict_and_clamps():
    scores = parse_scores(
        {
            "scores": [
                {"trajectory_id": "1", "explanation": "", "score": 7},
                {"trajectory_id": "2", "explanation": "", "score": -0.5},
            ]
        },
        2,
    )
    assert [s.score for s in scores] == [1.0, 0.0]


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (scores_json(("1", 0.5)), "missing ids ['2']"),
        (scores_json(("1", 0.5), ("1", 0.6)), "more than once"),
        (scores_json(("1", 0.5), ("2", 0.6), ("3", 0.1)), "unknown trajectory id '3'"),
        ("{not json", "not valid JSON"),
        ('{"answer": 1}', 'no "scores" list'),
        ('{"scores": [{"trajectory_id": "1", "explanation": "", "score": "high"}]}', "not a number"),
        ('{"scores": [{"trajectory_id": "1", "explanation": "", "score": null}]}', "not a number"),
        ('{"scores": [{"trajectory_id": "1", "explanation": "", "score": NaN}]}', "not finite"),
        ('{"scores": [{"trajectory_id": "1", "explanation": "", "score": Infinity}]}', "not finite"),
    ],
)
def test_parse_rejects(answer, message):
    with pytest.raises(RulerError) as info:
        parse_scores(answer, 2)
    assert message in str(info.value)


async def test_ruler_empty_needs_no_judge():
    assert await ruler([]) == []


# ---------------------------------------------------------------- a real HTTP judge


@pytest.fixture
def judge():
    with serve_scripted_judge() as j:
        yield j


def make_group() -> art.TrajectoryGroup:
    return art.TrajectoryGroup(
        [
            art.Trajectory(messages_and_choices=convo(answer), reward=reward)
            for answer, reward in [("4", 1.0), ("5", 0.0), ("four", 0.5)]
        ]
    )


async def test_score_group_sets_rewards(judge):
    judge.answers = [scores_json(("1", 0.9), ("2", 0.1), ("3", 0.7))]
    group = make_group()
    scored = await ruler_score_group(group, judge_model="openai/judge", extra_litellm_params=judge.params())
    assert scored is not None and scored is not group
    assert [t.reward for t in scored] == [0.9, 0.1, 0.7]
    assert [t.metrics["ruler_score"] for t in scored] == [0.9, 0.1, 0.7]
    assert [t.metrics["independent_reward"] for t in scored] == [1.0, 0.0, 0.5]
    assert scored.trajectories[0].logs[-1] == "RULER explanation: why 1"
    # The original group is untouched.
    assert [t.reward for t in group] == [1.0, 0.0, 0.5]
    assert all("ruler_score" not in t.metrics for t in group)
    # What the judge saw: ART's prompt and the JSON schema response format.
    assert len(judge.requests) == 1
    body = judge.requests[0]
    assert body["model"] == "judge"
    assert body["messages"] == build_judge_messages([t.messages() for t in group], DEFAULT_RUBRIC)
    assert body["response_format"]["type"] == "json_schema"


async def test_score_group_shuffled_ids(judge):
    judge.answers = [scores_json(("2", 0.2), ("3", 0.3), ("1", 0.8))]
    scored = await ruler_score_group(make_group(), "openai/judge", judge.params())
    assert [t.reward for t in scored] == [0.8, 0.2, 0.3]
    assert [t.logs[-1] for t in scored] == [f"RULER explanation: why {i}" for i in "123"]


async def test_score_group_retries_missing_id(judge):
    judge.answers = [scores_json(("1", 0.9), ("2", 0.1)), scores_json(("1", 0.6), ("2", 0.4), ("3", 0.5))]
    scored = await ruler_score_group(make_group(), "openai/judge", judge.params())
    assert [t.reward for t in scored] == [0.6, 0.4, 0.5]
    assert len(judge.requests) == 2


async def test_score_group_always_malformed(judge):
    judge.answers = ["this is not JSON at all"]
    with pytest.raises(RulerError) as info:
        await ruler_score_group(make_group(), "openai/judge", judge.params())
    assert "after 2 attempts" in str(info.value) and "this is not JSON" in str(info.value)
    assert len(judge.requests) == 2
    swallowed = await ruler_score_group(make_group(), "openai/judge", judge.params(), swallow_exceptions=True)
    assert swallowed is None
    assert len(judge.requests) == 4


async def test_identical_trajectories_share_one_score(judge):
    judge.answers = [scores_json(("1", 0.75))]
    group = art.TrajectoryGroup([art.Trajectory(messages_and_choices=convo("4")) for _ in range(3)])
    scored = await ruler_score_group(group, "openai/judge", judge.params())
    assert [t.reward for t in scored] == [0.75, 0.75, 0.75]


async def test_additional_histories_rejected():
    group = art.TrajectoryGroup(
        [art.Trajectory(messages_and_choices=convo("4"), additional_histories=[art.History(convo("5"))])]
    )
    with pytest.raises(ValueError, match="additional_histories"):
        await ruler_score_group(group, "openai/judge")
