"""Trajectories to training sequences, on the tiny test model's tokenizer (ChatML, Hermes tools)."""

from __future__ import annotations

import json
import math
from typing import Any

import msgspec
import pytest
import torch

from artery.schemas import (
    FunctionCall,
    FunctionDefinition,
    History,
    Message,
    Sample,
    Tool,
    ToolCall,
    Trajectory,
)
from artery.services.inference.chat import decode_request, render_prompt
from artery.services.trainer.conversation import tokenize_conversation
from artery.services.trainer.sequences import (
    TrainingSequence,
    build_sequences,
    pad_batch,
    trajectory_sequences,
)


@pytest.fixture(scope="module")
def tok() -> Any:
    from transformers import AutoTokenizer

    from artery.shared.tiny_model import tiny_model_path

    return AutoTokenizer.from_pretrained(tiny_model_path())


def end_id(tok: Any) -> int:
    return tok.convert_tokens_to_ids("<|im_end|>")


def sample_of(tok: Any, text: str, *, stop: bool = True, start: float = 0.01) -> Sample:
    """What the engine returns: the sampled ids (stop token included) and a distinct logprob each."""
    ids = tok.encode(text, add_special_tokens=False) + ([end_id(tok)] if stop else [])
    return Sample(token_ids=ids, logprobs=[-(start + i / 100) for i in range(len(ids))])


def engine_prompt(tok: Any, messages: list[dict[str, Any]], tools: list[dict] | None = None) -> list[int]:
    """The prompt the engine renders for the next assistant turn (OpenAI-shaped messages)."""
    out = tok.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return list(out["input_ids"])


def trained(seq: TrainingSequence) -> list[int]:
    return [i for i, m in zip(seq.input_ids, seq.assistant_mask, strict=True) if m]


def one(tok: Any, trajectory: Trajectory, advantage: float = 1.0, **kwargs: Any) -> TrainingSequence:
    sequences, report = build_sequences([[trajectory]], [[advantage]], tok, max_seq_len=4096, **kwargs)
    assert len(sequences) == 1, report
    return sequences[0]


# --------------------------------------------------------------------------- splicing samples


def test_sampled_tokens_are_spliced_verbatim(tok: Any) -> None:
    # Sampled ids that the tokenizer would never produce from the text ("hello" letter by letter):
    # training must use them, not a re-tokenisation of the content.
    letters = [tok.convert_tokens_to_ids(c) for c in "hello"]
    assert tok.encode("hello", add_special_tokens=False) != letters
    sample = Sample(token_ids=[*letters, end_id(tok)], logprobs=[-0.1, -0.2, -0.3, -0.4, -0.5, -0.6])
    trajectory = Trajectory(
        messages=[
            Message(role="system", content="be brief"),
            Message(role="user", content="say hello"),
            Message(role="assistant", content="hello", sample=sample),
        ]
    )
    seq = one(tok, trajectory)
    prompt = engine_prompt(
        tok, [{"role": "system", "content": "be brief"}, {"role": "user", "content": "say hello"}]
    )
    n = len(prompt)
    # the engine's prompt, then exactly the sampled ids (stop token once): the sequence ends there
    assert seq.input_ids == [*prompt, *sample.token_ids]
    assert seq.assistant_mask == [0] * n + [1] * 6
    assert seq.old_logprobs[n : n + 6] == sample.logprobs
    assert all(math.isnan(lp) for i, lp in enumerate(seq.old_logprobs) if not n <= i < n + 6)
    assert seq.input_ids.count(end_id(tok)) == 3  # system, user, assistant: no duplicate end token


def test_a_sample_cut_by_length_is_continued_by_the_template_end_untrained(tok: Any) -> None:
    sample = sample_of(tok, "the answer is", stop=False)  # finish_reason "length": no stop token
    answer = sample_of(tok, "done")
    messages = [
        Message(role="user", content="what is it"),
        Message(role="assistant", content="the answer is", sample=sample),
    ]
    seq = one(tok, Trajectory(messages=messages))
    n = len(engine_prompt(tok, [{"role": "user", "content": "what is it"}]))
    k = len(sample.token_ids)
    assert seq.input_ids[n:] == sample.token_ids  # the last trained turn ends the sequence
    assert seq.assistant_mask == [0] * n + [1] * k

    # A later turn: its prompt closes the cut turn with the template's end token, which is context.
    later = [
        *messages,
        Message(role="user", content="go on"),
        Message(role="assistant", content="done", sample=answer),
    ]
    seq = one(tok, Trajectory(messages=later))
    assert seq.input_ids[n : n + k + 1] == [*sample.token_ids, end_id(tok)]
    assert seq.assistant_mask[n : n + k + 1] == [1] * k + [0]
    assert trained(seq) == [*sample.token_ids, *answer.token_ids]


def test_multi_turn_tool_calls_mask_only_assistant_tokens(tok: Any) -> None:
    tools = [
        Tool(
            function=FunctionDefinition(
                name="add", description="Add two numbers", parameters={"type": "object", "properties": {}}
            )
        )
    ]
    call_text = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    call_sample = sample_of(tok, call_text, start=0.5)
    answer_sample = sample_of(tok, "2 + 3 = 5", start=0.9)
    call = ToolCall(id="call_1", function=FunctionCall(name="add", arguments='{"a": 2, "b": 3}'))
    trajectory = Trajectory(
        messages=[
            Message(role="user", content="what is 2 + 3?"),
            Message(role="assistant", content=None, tool_calls=[call], sample=call_sample),
            Message(role="tool", tool_call_id="call_1", content='{"result": 5}'),
            Message(role="assistant", content="2 + 3 = 5", sample=answer_sample),
            Message(role="user", content="thanks"),  # after the last trained message: cut off
        ],
        tools=tools,
    )
    seq = one(tok, trajectory)

    # Only the two samples are trained, each verbatim with its logprobs.
    assert trained(seq) == [*call_sample.token_ids, *answer_sample.token_ids]
    got = [lp for lp, m in zip(seq.old_logprobs, seq.assistant_mask, strict=True) if m]
    assert got == [*call_sample.logprobs, *answer_sample.logprobs]

    # The context before each sample is what the engine was prompted with (OpenAI shapes).
    openai_tools = [
        {
            "type": "function",
            "function": {
                "name": "add",
                "description": "Add two numbers",
                "parameters": {"type": "object", "properties": {}},
            },
        }
    ]
    first = engine_prompt(tok, [{"role": "user", "content": "what is 2 + 3?"}], openai_tools)
    assert seq.input_ids[: len(first)] == first
    assert seq.input_ids[len(first) : len(first) + len(call_sample.token_ids)] == call_sample.token_ids
    history = [
        {"role": "user", "content": "what is 2 + 3?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "add", "arguments": {"a": 2, "b": 3}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"result": 5}'},
    ]
    second = engine_prompt(tok, history, openai_tools)
    assert seq.input_ids == [*second, *answer_sample.token_ids]
    assert "thanks" not in tok.decode(seq.input_ids)
    assert "<tool_response>" in tok.decode(seq.input_ids)  # the tool result is context, untrained


def inference_prompt(tok: Any, body: dict[str, Any]) -> list[int]:
    """The prompt the inference service renders for a chat request body (its own code path)."""
    request = decode_request(json.dumps({"model": "m", **body}).encode())
    return render_prompt(tok, request, max_context=4096)


ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}


def test_a_turn_whose_prompt_does_not_continue_the_turn_before_starts_its_own_sequence(tok: Any) -> None:
    # The model wrote its call compactly; the template re-renders the parsed call with tojson's
    # spacing, so the engine's prompt for the answer holds other tokens than the sampled call.
    call_sample = sample_of(tok, '<tool_call>\n{"name":"add","arguments":{"a":2,"b":3}}\n</tool_call>')
    answer_sample = sample_of(tok, "5", start=0.9)
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a":2,"b":3}'}}
    history = [
        {"role": "user", "content": "what is 2 + 3?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    ]
    trajectory = Trajectory(
        messages=[
            Message(role="user", content="what is 2 + 3?"),
            Message(role="assistant", tool_calls=[msgspec.convert(call, ToolCall)], sample=call_sample),
            Message(role="tool", tool_call_id="call_1", content="5"),
            Message(role="assistant", content="5", sample=answer_sample),
        ],
        tools=[msgspec.convert(ADD, Tool)],
    )
    sequences, report = build_sequences([[trajectory]], [[1.0]], tok, max_seq_len=4096)

    first = inference_prompt(tok, {"messages": history[:1], "tools": [ADD]})
    second = inference_prompt(tok, {"messages": history, "tools": [ADD]})
    assert second[: len(first) + len(call_sample.token_ids)] != first + call_sample.token_ids
    assert [s.input_ids for s in sequences] == [
        first + call_sample.token_ids,
        second + answer_sample.token_ids,
    ]
    assert [trained(s) for s in sequences] == [call_sample.token_ids, answer_sample.token_ids]
    assert [s.part_index for s in sequences] == [0, 1]
    assert report.split == 1 and report.counts()["sequences_split"] == 1


def test_sampled_ids_the_template_would_tokenise_otherwise_split_the_conversation(tok: Any) -> None:
    letters = [tok.convert_tokens_to_ids(c) for c in "hello"]  # "hello", letter by letter
    first = Sample(token_ids=[*letters, end_id(tok)], logprobs=[-0.1] * 6)
    second = sample_of(tok, "bye")
    trajectory = Trajectory(
        messages=[
            Message(role="user", content="say hello"),
            Message(role="assistant", content="hello", sample=first),
            Message(role="user", content="say bye"),
            Message(role="assistant", content="bye", sample=second),
        ]
    )
    sequences, report = build_sequences([[trajectory]], [[1.0]], tok, max_seq_len=4096)
    prompts = [
        inference_prompt(tok, {"messages": [{"role": "user", "content": "say hello"}]}),
        inference_prompt(
            tok,
            {
                "messages": [
                    {"role": "user", "content": "say hello"},
                    {"role": "assistant", "content": "hello"},
                    {"role": "user", "content": "say bye"},
                ]
            },
        ),
    ]
    assert [s.input_ids for s in sequences] == [prompts[0] + first.token_ids, prompts[1] + second.token_ids]
    assert [trained(s) for s in sequences] == [first.token_ids, second.token_ids]
    assert report.split == 1


def test_trainer_and_inference_refuse_the_same_conversations(tok: Any) -> None:
    from artery.services.inference.openai_types import ApiError

    answer = sample_of(tok, "ok")
    image = {"type": "image_url", "image_url": {"url": "data:,x"}}
    with_image = Trajectory(
        messages=[
            msgspec.convert({"role": "user", "content": [image]}, Message),
            Message(role="assistant", content="ok", sample=answer),
        ]
    )
    _, report = build_sequences([[with_image]], [[1.0]], tok, max_seq_len=4096)
    assert [d.reason for d in report.dropped] == ["unsupported_content"]
    with pytest.raises(ApiError) as refused:
        inference_prompt(tok, {"messages": [{"role": "user", "content": [image]}]})
    error = refused.value.body.error
    assert refused.value.status == 400 and error.param == "messages[0]" and "image_url" in error.message

    # Template variables may not set what the renderer sets itself, nor replace the template.
    for variables in ({"tools": 1}, {"chat_template": "{{ 'x' * 1000000000 }}"}):
        name = next(iter(variables))
        _, report = build_sequences(
            [[_qa(tok)]], [[1.0]], tok, max_seq_len=4096, chat_template_kwargs=variables
        )
        assert [d.reason for d in report.dropped] == ["template"] and name in report.dropped[0].detail
        user = [{"role": "user", "content": "hi"}]
        with pytest.raises(ApiError) as refused:
            inference_prompt(tok, {"messages": user, "chat_template_kwargs": variables})
        assert refused.value.status == 400 and name in refused.value.body.error.message


def test_assistant_messages_without_sample(tok: Any) -> None:
    messages = [
        Message(role="user", content="hi"),
        Message(role="assistant", content="hello there"),  # no sample, trainable unset
        Message(role="user", content="and now"),
        Message(role="assistant", content="the answer", sample=sample_of(tok, "the answer")),
    ]
    plain = Trajectory(messages=messages)
    seq = one(tok, plain)
    assert trained(seq) == sample_of(tok, "the answer").token_ids  # the plain one is context only

    seq = one(tok, plain, allow_training_without_logprobs=True)
    hello = [*tok.encode("hello there", add_special_tokens=False), end_id(tok)]
    assert trained(seq) == [*hello, *sample_of(tok, "the answer").token_ids]
    nan_positions = [i for i, m in enumerate(seq.assistant_mask) if m and math.isnan(seq.old_logprobs[i])]
    assert len(nan_positions) == len(hello)  # the template's tokens, without sampler logprobs

    # trainable=True trains a message without sample; trainable=False keeps a sampled one out.
    forced = Trajectory(
        messages=[
            Message(role="user", content="hi"),
            Message(role="assistant", content="hello there", trainable=True),
            Message(role="user", content="and now"),
            Message(
                role="assistant", content="the answer", sample=sample_of(tok, "the answer"), trainable=False
            ),
        ]
    )
    seq = one(tok, forced)
    assert trained(seq) == hello
    assert "the answer" not in tok.decode(seq.input_ids)  # cut after the last trained message


def test_template_without_generation_markers(tok: Any) -> None:
    import copy

    plain = copy.deepcopy(tok)
    plain.chat_template = tok.chat_template.replace("{%- generation %}", "").replace(
        "{%- endgeneration %}", ""
    )
    sample = sample_of(tok, "ok")
    trajectory = Trajectory(
        messages=[
            Message(role="user", content="hi"),
            Message(role="assistant", content="hello", trainable=True),
            Message(role="user", content="again"),
            Message(role="assistant", content="ok", sample=sample),
        ]
    )
    # Samples are spliced by the placeholder, which needs no markers; a message without sample needs them.
    only_sampled = Trajectory(messages=[trajectory.messages[0], trajectory.messages[3]])
    assert trained(one(plain, only_sampled)) == sample.token_ids
    sequences, report = build_sequences([[trajectory]], [[1.0]], plain, max_seq_len=4096)
    assert sequences == []
    assert [(d.reason, d.history_index) for d in report.dropped] == [("template", 0)]
    assert "generation" in report.dropped[0].detail


# --------------------------------------------------------------------------- report: cut, drop, skip


def _qa(tok: Any, answer: str = "one two three four five six seven eight nine ten") -> Trajectory:
    return Trajectory(
        messages=[
            Message(role="user", content="count to ten"),
            Message(role="assistant", content=answer, sample=sample_of(tok, answer)),
        ]
    )


def test_too_long_is_cut_or_dropped(tok: Any) -> None:
    trajectory = _qa(tok)
    full = one(tok, trajectory)
    prompt = len(engine_prompt(tok, [{"role": "user", "content": "count to ten"}]))
    assert len(full.input_ids) > prompt + 3

    cut, report = build_sequences([[trajectory]], [[1.0]], tok, max_seq_len=prompt + 3)
    assert len(cut) == 1 and len(cut[0].input_ids) == prompt + 3
    assert cut[0].input_ids == full.input_ids[: prompt + 3]
    assert cut[0].assistant_mask == full.assistant_mask[: prompt + 3]
    assert sum(cut[0].assistant_mask) == 3
    assert [(c.length, c.kept) for c in report.cut] == [(len(full.input_ids), prompt + 3)]
    assert report.counts()["sequences_cut"] == 1

    dropped, report = build_sequences([[trajectory]], [[1.0]], tok, max_seq_len=prompt)
    assert dropped == []
    assert [d.reason for d in report.dropped] == ["too_long"]
    assert report.counts() == {
        "trajectories": 1,
        "trajectories_used": 0,
        "sequences": 0,
        "sequences_cut": 0,
        "sequences_split": 0,
        "dropped/too_long": 1,
    }


def test_zero_advantage_is_skipped(tok: Any) -> None:
    group = [_qa(tok, "yes"), _qa(tok, "no"), _qa(tok, "maybe")]
    sequences, report = build_sequences([group], [[0.5, 0.0, -0.5]], tok, max_seq_len=4096)
    assert [(s.trajectory_index, s.advantage) for s in sequences] == [(0, 0.5), (2, -0.5)]
    assert [(d.trajectory_index, d.history_index, d.reason) for d in report.dropped] == [
        (1, None, "zero_advantage")
    ]
    assert (report.trajectories, report.used, report.sequences) == (3, 2, 2)


def test_no_trainable_message_and_bad_sample_are_dropped(tok: Any) -> None:
    no_train = Trajectory(
        messages=[Message(role="user", content="hi"), Message(role="assistant", content="hello")]
    )
    bad = Trajectory(
        messages=[
            Message(role="user", content="hi"),
            Message(role="assistant", content="hello", sample=Sample(token_ids=[1, 2, 3], logprobs=[-0.1])),
        ]
    )
    sequences, report = build_sequences(
        [[no_train, bad, _qa(tok)]], [[1.0, -1.0, 2.0]], tok, max_seq_len=4096
    )
    assert [s.trajectory_index for s in sequences] == [2]
    assert [(d.trajectory_index, d.reason) for d in report.dropped] == [
        (0, "no_trainable_message"),
        (1, "bad_sample"),
    ]
    assert report.counts()["dropped/bad_sample"] == 1


def test_additional_histories_are_their_own_sequences(tok: Any) -> None:
    sub = sample_of(tok, "sub answer")
    trajectory = _qa(tok, "main answer")
    trajectory.additional_histories = [
        History(
            messages=[
                Message(role="system", content="you are a helper"),
                Message(role="user", content="sub question"),
                Message(role="assistant", content="sub answer", sample=sub),
            ]
        ),
        History(messages=[Message(role="user", content="nothing to train")]),
    ]
    sequences, cuts, dropped, split = trajectory_sequences(
        trajectory, -0.75, tok, max_seq_len=4096, group_index=3, trajectory_index=4
    )
    assert [(s.history_index, s.advantage, s.group_index, s.trajectory_index) for s in sequences] == [
        (0, -0.75, 3, 4),
        (1, -0.75, 3, 4),
    ]
    assert trained(sequences[1]) == sub.token_ids
    assert "you are a helper" in tok.decode(sequences[1].input_ids)
    assert cuts == [] and split == 0
    assert [(d.history_index, d.reason) for d in dropped] == [(2, "no_trainable_message")]


def test_tokenize_conversation_is_deterministic(tok: Any) -> None:
    trajectory = _qa(tok)
    a = tokenize_conversation(trajectory.messages, None, tok)
    b = tokenize_conversation(trajectory.messages, None, tok)
    assert len(a) == 1 and a[0].input_ids == b[0].input_ids and a[0].assistant_mask == b[0].assistant_mask


class CountingTokenizer:
    """The tokenizer, counting the chat template's renderings."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok
        self.renders = 0

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        self.renders += 1
        return self.tok.apply_chat_template(*args, **kwargs)

    def __len__(self) -> int:
        return len(self.tok)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tok, name)


def _asked(tok: Any, question: str, answer: str) -> Trajectory:
    return Trajectory(
        messages=[
            Message(role="system", content="answer briefly"),
            Message(role="user", content=question),
            Message(role="assistant", content=answer, sample=sample_of(tok, answer)),
        ]
    )


def test_a_groups_shared_prompt_is_rendered_once_per_step(tok: Any) -> None:
    groups = [
        [_asked(tok, "count to three", a) for a in ("one two three", "1 2 3", "one, two, three")],
        [_asked(tok, "name a colour", a) for a in ("red", "blue")],
        # Same words, other roles: another prompt, never the first group's.
        [
            Trajectory(
                messages=[
                    Message(role="user", content="answer briefly"),
                    Message(role="user", content="count to three"),
                    Message(role="assistant", content="three", sample=sample_of(tok, "three")),
                ]
            )
        ],
    ]
    advantages = [[1.0, -0.5, 0.5], [1.0, -1.0], [1.0]]
    counting = CountingTokenizer(tok)
    shared, _ = build_sequences(groups, advantages, counting, max_seq_len=4096)
    assert counting.renders == 3  # one per distinct prompt, not one per rollout (6)

    alone = []
    for g, (group, adv) in enumerate(zip(groups, advantages, strict=True)):
        for t, (trajectory, a) in enumerate(zip(group, adv, strict=True)):
            made, *_ = trajectory_sequences(
                trajectory, a, tok, max_seq_len=4096, group_index=g, trajectory_index=t
            )
            alone += made
    assert [(s.input_ids, s.assistant_mask, s.advantage) for s in shared] == [
        (s.input_ids, s.assistant_mask, s.advantage) for s in alone
    ]
    system, user = "system", "user"
    expected = [
        [(system, "answer briefly"), (user, "count to three")],
        [(system, "answer briefly"), (user, "name a colour")],
        [(user, "answer briefly"), (user, "count to three")],
    ]
    prompts = {tuple(s.input_ids[: s.assistant_mask.index(1)]) for s in shared}
    assert prompts == {
        tuple(engine_prompt(tok, [{"role": r, "content": c} for r, c in messages])) for messages in expected
    }


def test_a_prompt_json_cannot_key_is_rendered_each_time(tok: Any) -> None:
    from artery.services.trainer.conversation import Prompts
    from artery.shared.chat_template import ChatInput

    class Opaque:  # a template variable JSON cannot encode: no key, so no sharing
        def __str__(self) -> str:
            return "opaque"

    chat = ChatInput.of([Message(role="user", content="hi")], None, {"extra": Opaque()})
    prompts, counting = Prompts(), CountingTokenizer(tok)
    first = prompts.token_ids(chat, counting)
    assert prompts.token_ids(chat, counting) == first == chat.prompt_token_ids(tok)
    assert counting.renders == 2


# --------------------------------------------------------------------------- padding and shifting


def test_pad_batch_shifts_for_next_token_prediction() -> None:
    nan = float("nan")
    long = TrainingSequence(
        input_ids=[10, 11, 12, 13, 14],
        assistant_mask=[0, 0, 1, 1, 0],
        old_logprobs=[nan, nan, -0.2, -0.3, nan],
        advantage=1.5,
        group_index=0,
        trajectory_index=1,
    )
    short = TrainingSequence(
        input_ids=[20, 21, 22],
        assistant_mask=[0, 1, 1],
        old_logprobs=[nan, -0.5, -0.6],
        advantage=-1.0,
        group_index=2,
        trajectory_index=0,
    )
    batch = pad_batch([long, short], pad_id=0)
    assert batch["input_ids"].tolist() == [[10, 11, 12, 13, 14], [20, 21, 22, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    # mask[b, t] is about input_ids[b, t + 1], predicted by the logits at t: [B, T - 1]
    assert batch["assistant_mask"].tolist() == [[0, 1, 1, 0], [1, 1, 0, 0]]
    old = batch["old_logprobs"]
    assert old.shape == (2, 4)
    assert old[0, 1].item() == pytest.approx(-0.2) and old[0, 2].item() == pytest.approx(-0.3)
    assert old[1, 0].item() == pytest.approx(-0.5) and old[1, 1].item() == pytest.approx(-0.6)
    assert torch.isnan(old[batch["assistant_mask"] == 0]).all()
    assert batch["advantages"].tolist() == [1.5, -1.0]
    assert batch["group_index"].tolist() == [0, 2] and batch["trajectory_index"].tolist() == [1, 0]

    # The shift lines up with a causal LM: logits[:, :-1] scored against input_ids[:, 1:].
    targets = batch["input_ids"][:, 1:]
    assert targets[batch["assistant_mask"].bool()].tolist() == [12, 13, 21, 22]


def test_pad_batch_of_real_sequences(tok: Any) -> None:
    sequences, _ = build_sequences(
        [[_qa(tok, "yes"), _qa(tok, "no no no")]], [[1.0, -1.0]], tok, max_seq_len=4096
    )
    batch = pad_batch(sequences, pad_id=tok.pad_token_id)
    targets = batch["input_ids"][:, 1:]
    for row, seq in enumerate(sequences):
        assert targets[row][batch["assistant_mask"][row].bool()].tolist() == trained(seq)
    with pytest.raises(ValueError):
        pad_batch([], pad_id=0)


def test_one_training_step_on_the_tiny_model(tok: Any) -> None:
    """pad_batch lines up with a causal LM: one cispo step raises the trained tokens' logprobs."""
    from transformers import AutoModelForCausalLM

    from artery.services.trainer.losses import LossConfig, LossInputs, select_loss
    from artery.shared.tiny_model import tiny_model_path

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path())
    sequences, _ = build_sequences(
        [[_qa(tok, "yes yes"), _qa(tok, "no")]], [[1.0, 1.0]], tok, max_seq_len=4096
    )
    batch = pad_batch(sequences, pad_id=tok.pad_token_id)

    def logprobs() -> torch.Tensor:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits  # [B,T,V]
        targets = batch["input_ids"][:, 1:].unsqueeze(-1)  # [B,T-1,1]
        return logits[:, :-1].log_softmax(-1).gather(-1, targets).squeeze(-1)  # [B,T-1]

    mask = batch["assistant_mask"]  # [B,T-1]
    before = logprobs()
    loss_fn = select_loss(LossConfig(name="cispo"))
    out = loss_fn(
        LossInputs(
            logprobs=before, old_logprobs=batch["old_logprobs"], advantages=batch["advantages"], mask=mask
        )
    )
    assert torch.isfinite(out.loss)
    out.loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    with torch.no_grad():
        after = logprobs()
    assert ((after - before.detach()) * mask).sum() > 0
