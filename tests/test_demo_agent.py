"""``make demo-agent``: its reward rule (degenerate episodes included), its tool, its command line,
and the whole run in miniature on the tiny model through the real services, scored by the
programmatic reward and by a scripted RULER judge."""

from __future__ import annotations

import json
import re

import msgspec
import pytest

from artery.demos.demo_agent import agent, cli, task
from artery.demos.demo_agent.run import question_sets, run
from artery.demos.demo_agent.task import Episode, ToolResult, reward, reward_parts, run_tool
from artery.testing.judge import serve_scripted_judge
from tests.example_helpers import scores_by_id

RIGHT = ToolResult('{"result": 444}', True, 444.0)
WRONG = ToolResult('{"result": 49}', True, 49.0)
BAD = ToolResult('{"error": "not an arithmetic expression"}', False)


def test_calculator_runs_arithmetic_only():
    assert run_tool("calculator", '{"expression": "37 * 12"}') == RIGHT
    assert run_tool("calculator", '{"expression": "1 / 4"}').content == '{"result": 0.25}'
    for name, arguments in [
        ("calculator", '{"expression": "__import__(\'os\')"}'),
        ("calculator", '{"expression": "2 ** 99"}'),
        ("calculator", '{"expression": "1 / 0"}'),
        ("calculator", '{"expression": "9" }'.replace("9", "9" * 200)),
        ("calculator", "not json"),
        ("calculator", '["37 * 12"]'),
        ("calculator", '{"expr": "37 * 12"}'),
        ("calculator", '{"expression": true}'),
        ("search", '{"expression": "37 * 12"}'),
    ]:
        result = run_tool(name, arguments)
        assert not result.valid and result.value is None and "error" in json.loads(result.content)


@pytest.mark.parametrize(
    ("episode", "expected"),
    [
        (Episode([RIGHT], "444", 2), 1.0),
        (Episode([RIGHT], "The answer is 444.", 2), 1.0),
        (Episode([RIGHT], "4,44", 2), 1.0),  # thousands separators are dropped before reading
        (Episode([BAD, RIGHT], "444", 3), 1.0),  # a failed call, then a right one
        # A valid call, but the answer is wrong, missing, cut off, or lists several numbers.
        (Episode([RIGHT], "445", 2), 0.2),
        (Episode([RIGHT], "", 2), 0.2),
        (Episode([RIGHT], None, 3), 0.2),
        (Episode([RIGHT], "444 445 446", 2), 0.2),
        (Episode([RIGHT], "37 * 12 = 444", 2), 0.2),
        # The tool computed something else: the right number answered anyway is not rewarded.
        (Episode([WRONG], "444", 2), 0.2),
        (Episode([WRONG], "49", 2), 0.2),
        # No valid call: a right number guessed, a malformed call, prose, nothing at all.
        (Episode([], "444", 1), 0.0),
        (Episode([BAD], "444", 2), 0.0),
        (Episode([], "<tool_call>{nonsense", 1), 0.0),
        (Episode([], "", 1), 0.0),
        (Episode([], None, 3), 0.0),
    ],
)
def test_reward_rule(episode, expected):
    assert reward(episode, 444) == expected


def test_reward_parts_explain_the_reward():
    assert reward_parts(Episode([RIGHT], "444", 2), 444) == {
        "valid_call": 1.0,
        "right_call": 1.0,
        "answered": 1.0,
        "correct": 1.0,
    }
    assert reward_parts(Episode([BAD], None, 3), 444) == {
        "valid_call": 0.0,
        "right_call": 0.0,
        "answered": 0.0,
        "correct": 0.0,
    }


def test_questions_are_fixed_and_held_out_ones_never_trained_on():
    args = cli.parse_args([])
    train, held_out = question_sets(args)
    assert question_sets(args) == (train, held_out)
    assert {q.kind for q in held_out} == set(task.KINDS)
    assert not {q.text for q in train} & {q.text for q in held_out}
    with pytest.raises(ValueError, match="distinct questions"):  # a kind has a few hundred
        task.questions(("convert",), 1000, 0)
    for q in held_out:  # every answer is what the right calculator call returns
        expression = {"times": q.text[8:-1]}.get(q.kind)
        if expression:
            assert run_tool("calculator", json.dumps({"expression": expression})).value == q.answer


def test_prompt_shows_the_call_format_and_one_worked_example():
    q = task.Question("What is 37 * 12?", 444, "times")
    messages = agent.prompt(q)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant", "user"]
    assert "<tool_call>" in messages[0]["content"] and messages[-1]["content"] == q.text
    call = messages[2]["content"]
    assert call.startswith("<tool_call>\n") and call.endswith("\n</tool_call>")
    body = json.loads(call.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
    assert run_tool(body["name"], json.dumps(body["arguments"])).content == messages[3]["content"]
    assert (
        agent.call_text("calculator", "{bad json")
        == '<tool_call>\n{"name": "calculator", "arguments": "{bad json"}\n</tool_call>'
    )


class ScriptedEndpoint:
    """The OpenAI client's ``chat.completions.create``: a tool call, then the answer, each with
    its sampled token ids and logprobs (as Artery's inference returns them); records what it is sent."""

    def __init__(self):
        self.sent: list[list[dict]] = []
        self.chat = self.completions = self

    def openai_client(self):
        return self

    def get_inference_name(self):
        return "agent@0"

    async def create(self, *, messages, **kwargs):
        from openai.types.chat import ChatCompletion

        self.sent.append([dict(m) for m in messages])
        if len(self.sent) == 1:
            message = {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "calculator", "arguments": '{"expression": "37 * 12"}'},
                    }
                ],
            }
            tokens, finish = [11, 12, 13], "tool_calls"
        else:
            message, tokens, finish = {"role": "assistant", "content": "444"}, [21, 22], "stop"
        logprobs = {
            "content": [
                {"token": f"t{t}", "logprob": -0.5, "bytes": None, "top_logprobs": []} for t in tokens
            ]
        }
        return ChatCompletion.model_validate(
            {
                "id": "c",
                "object": "chat.completion",
                "created": 0,
                "model": "agent@0",
                "choices": [
                    {
                        "index": 0,
                        "message": message,
                        "finish_reason": finish,
                        "logprobs": logprobs,
                        "token_ids": tokens,
                    }
                ],
            }
        )


async def test_the_trajectory_holds_each_turn_as_it_went_back_to_the_model():
    """The trainer renders each sampled turn's prompt from the stored messages: they must be what
    the model was sent (the call written out, as it went back), with every turn's sampled tokens."""
    from artery.convert import to_messages

    endpoint = ScriptedEndpoint()
    q = task.Question("What is 37 * 12?", 444, "times")
    trajectory = await agent.rollout(endpoint, q, temperature=0.7)
    assert trajectory.reward == 1.0
    stored = [msgspec.to_builtins(m) for m in to_messages(trajectory.messages_and_choices)]
    last_request = endpoint.sent[-1]
    assert len(stored) == len(last_request) + 1  # the final answer follows what was sent last
    for sent, kept in zip(last_request, stored, strict=False):
        assert {k: kept.get(k) for k in sent} == sent, (sent, kept)
        assert not kept.get("tool_calls")
    samples = [m["sample"]["token_ids"] for m in stored if m.get("sample")]
    assert samples == [[11, 12, 13], [21, 22]]  # both turns trained, as sampled


def test_presets_fill_what_the_command_line_leaves_out():
    args = cli.parse_args(["--model", "tiny", "--steps", "3", "--kinds", "words"])
    assert (args.base_model, args.steps, args.kinds, args.learning_rate) == (
        "artery/tiny-random",
        3,
        ("words",),
        1e-2,
    )
    args = cli.parse_args(["--base-model", "Qwen/Qwen2.5-0.5B-Instruct", "--device", "cuda"])
    assert (args.base_model, args.device, args.steps) == ("Qwen/Qwen2.5-0.5B-Instruct", "cuda", 20)
    with pytest.raises(SystemExit):
        cli.parse_args(["--kinds", "division"])
    with pytest.raises(SystemExit):
        cli.parse_args(["--judge-api-base", "http://127.0.0.1:1/v1"])


def _check_summary(home, summary, steps):
    saved = json.loads((home / "summary.json").read_text())
    assert saved == json.loads(json.dumps(summary))
    assert saved["steps"] == steps and [p["step"] for p in saved["curve"]] == list(range(steps))
    before, after = saved["held_out"]["before"], saved["held_out"]["after"]
    assert (before["step"], after["step"]) == (0, steps)
    for figures in (before, after):
        for key in ("greedy", "sampled", "greedy_success", "sampled_success", "sampled_valid_call"):
            assert 0.0 <= figures[key] <= 1.0
        assert 0.0 <= figures["sampled_tool_call_validity"] <= 1.0
        assert 1 <= figures["sampled_turns"] <= saved["settings"]["max_turns"]
        assert set(figures["sampled_success_by_kind"]) == set(task.KINDS)
    assert saved["reward_start"] == before["sampled"] and saved["reward_end"] == after["sampled"]
    assert saved["success_gain"] == pytest.approx(after["sampled_success"] - before["sampled_success"])
    assert (home / "reward_curve.png").stat().st_size > 1000
    return saved


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_demo_agent_runs_every_service_and_writes_summary_and_plot(tmp_path):
    home = tmp_path / "demo-agent"
    args = cli.parse_args(["--model", "tiny", "--home", str(home), "--steps", "2", "--torch-threads", "1"])
    summary = await run(args)
    saved = _check_summary(home, summary, 2)
    assert saved["reward"] == "programmatic" and saved["judge_failures"] == 0
    # The tiny random model never writes a tool call: every episode is one turn and scores 0.
    assert saved["held_out"]["before"]["sampled_turns"] == 1.0


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_demo_agent_trains_on_a_ruler_judges_scores(tmp_path):
    home = tmp_path / "demo-agent"
    with serve_scripted_judge() as judge:
        judge.answers = [scores_by_id]
        args = cli.parse_args(
            [
                *("--model", "tiny", "--home", str(home), "--steps", "1", "--torch-threads", "1"),
                *("--judge-model", "openai/judge", "--judge-api-base", judge.api_base),
            ]
        )
        summary = await run(args)
    saved = _check_summary(home, summary, 1)
    assert saved["reward"] == "ruler:openai/judge" and saved["judge_failures"] == 0
    # One judge call per training group (evaluation keeps the programmatic reward), with the tool
    # and every episode of the group in its prompt.
    assert len(judge.requests) == args.groups
    for body in judge.requests:
        text = "\n".join(str(m.get("content")) for m in body["messages"])
        assert "calculator" in text and len(set(re.findall(r'<trajectory id="(\d+)">', text))) == 4
    # The judge's 1/4, 2/4, 3/4, 1 in each group is what was trained on.
    assert saved["curve"][0]["reward_mean"] == pytest.approx(2.5 / 4)
