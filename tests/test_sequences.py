"""Trajectories to training sequences, on the tiny test model's tokenizer (ChatML, Hermes tools)."""

from __future__ import annotations

import math
from typing import Any

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
from artery.services.trainer.sequences import (
    TrainingSequence,
    build_sequences,
    pad_batch,
    tokenize_conversation,
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
    # prompt, then exactly the sampled ids (stop token once), then the template's trailing newline
    assert seq.input_ids == [*prompt, *sample.token_ids, *tok.encode("\n", add_special_tokens=False)]
    assert seq.assistant_mask == [0] * n + [1] * 6 + [0]
    assert seq.old_logprobs[n : n + 6] == sample.logprobs
    assert all(math.isnan(lp) for i, lp in enumerate(seq.old_logprobs) if not n <= i < n + 6)
    assert seq.input_ids.count(end_id(tok)) == 3  # system, user, assistant: no duplicate end token


def test_sample_cut_by_length_keeps_the_template_end_untrained(tok: Any) -> None:
    sample = sample_of(tok, "the answer is", stop=False)  # finish_reason "length": no stop token
    trajectory = Trajectory(
        messages=[
            Message(role="user", content="what is it"),
            Message(role="assistant", content="x", sample=sample),
        ]
    )
    seq = one(tok, trajectory)
    n = len(engine_prompt(tok, [{"role": "user", "content": "what is it"}]))
    k = len(sample.token_ids)
    assert seq.input_ids[n : n + k] == sample.token_ids
    assert seq.input_ids[n + k] == end_id(tok)  # the template closes the turn, untrained
    assert seq.assistant_mask[n : n + k + 1] == [1] * k + [0]


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
    assert seq.input_ids[: len(second)] == second
    assert seq.input_ids[len(second) :] == [
        *answer_sample.token_ids,
        *tok.encode("\n", add_special_tokens=False),
    ]
    assert "thanks" not in tok.decode(seq.input_ids)
    assert "<tool_response>" in tok.decode(seq.input_ids)  # the tool result is context, untrained


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
    sequences, cuts, dropped = trajectory_sequences(
        trajectory, -0.75, tok, max_seq_len=4096, group_index=3, trajectory_index=4
    )
    assert [(s.history_index, s.advantage, s.group_index, s.trajectory_index) for s in sequences] == [
        (0, -0.75, 3, 4),
        (1, -0.75, 3, 4),
    ]
    assert trained(sequences[1]) == sub.token_ids
    assert "you are a helper" in tok.decode(sequences[1].input_ids)
    assert cuts == []
    assert [(d.history_index, d.reason) for d in dropped] == [(2, "no_trainable_message")]


def test_tokenize_conversation_is_deterministic(tok: Any) -> None:
    trajectory = _qa(tok)
    a = tokenize_conversation(trajectory.messages, None, tok)
    b = tokenize_conversation(trajectory.messages, None, tok)
    assert a.input_ids == b.input_ids and a.assistant_mask == b.assistant_mask


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
