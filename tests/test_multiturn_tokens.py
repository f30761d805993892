"""A multi-turn tool-using trajectory is trained on exactly the tokens the engine saw and sampled.

A real inference replica (a process, against the test's NATS) serves SmolLM2-135M-Instruct: the
tiny random test model never writes a valid tool call, SmolLM2 does when shown a worked example. An
agent plays a conversation through the OpenAI API with the SDK's ``Trajectory``, as agent code does:
a tool call (parsed by our inference from the model's Hermes text), the tool's result, an answer,
a follow-up question and another answer. Each response carries the prompt the engine was given
(``prompt_token_ids``) and the ids and logprobs it sampled. The trajectory then goes the way of a
stored one (``to_wire``, JSON) into the trainer's ``build_sequences`` with the tokenizer the trainer
loads, and for every turn:

- the trainer's tokens are the engine's prompt followed by the engine's sampled ids;
- the trained mask covers exactly the sampled ids, with the engine's logprobs, and nothing else
  (no system, user, tool or template token);
- the trainer's model, run over the sequences, gives the engine's logprobs at the trained positions
  (so the mask is not off by a token).

SmolLM2's chat template knows neither tools nor tool calls: the engine's prompt for the turn after a
tool call shows that turn as an empty assistant message, not as the sampled call. Such a turn cannot
share a sequence with the one before it, and the trainer splits the conversation there; which turns
continue their predecessor's tokens is read from the engine's own prompts, not assumed here.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
from dataclasses import dataclass

import msgspec
import openai
import pytest
import torch

import artery as art
from artery.schemas import Trajectory
from artery.services.trainer.sequences import build_sequences, pad_batch
from artery.shared import smollm2
from artery.shared.control_client import live_replicas
from artery.shared.models import SMOLLM2, resolve_base_model
from tests.helpers import wait_for

pytestmark = pytest.mark.timeout(420)
PROJECT, MODEL = "mt", "agent"
TEMPERATURE = 0.7
#: A tool call is ~25 tokens; an answer is cut here if it rambles (the tokens still must agree).
MAX_TOKENS = 40
#: Seeds tried (with ``CALL_CHOICES`` choices each) for a turn that must be a tool call. SmolLM2
#: writes one about a quarter of the time after the worked example below.
CALL_SEEDS = range(1, 9)
CALL_CHOICES = 4

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                "required": ["a", "b"],
            },
        },
    }
]
# SmolLM2's template does not render ``tools``: the system prompt tells the model how to call.
SYSTEM = (
    "You can use the tool add(a, b), which adds two numbers. To call it, answer with only:\n"
    '<tool_call>\n{"name": "add", "arguments": {"a": <number>, "b": <number>}}\n</tool_call>'
)
WORKED_EXAMPLE = [
    {"role": "user", "content": "Call the tool: what is 12 + 30?"},
    {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "add", "arguments": {"a": 12, "b": 30}}\n</tool_call>',
    },
    {"role": "tool", "content": "42"},
    {"role": "assistant", "content": "12 + 30 = 42."},
]


@dataclass(frozen=True)
class Turn:
    """What the engine saw and did for one assistant message of the trajectory."""

    message_index: int
    prompt: list[int]
    sampled: list[int]
    logprobs: list[float]


@pytest.fixture
async def client(stack, js):
    if not smollm2.is_prepared():
        pytest.skip("SmolLM2 is not prepared here: `make prepare-model`")
    stack.start_service(
        "replica",
        service="inference",
        env={
            "ARTERY_INFERENCE_PROJECT": PROJECT,
            "ARTERY_INFERENCE_MODEL": MODEL,
            "ARTERY_INFERENCE_BASE_MODEL": SMOLLM2,
            "ARTERY_INFERENCE_REPLICA_ID": "replica",
            "ARTERY_INFERENCE_HEARTBEAT_S": "1",
            # One thread: the cores are shared with this test and whatever else runs; torch's
            # default (a thread per core) only makes them contend.
            "ARTERY_INFERENCE_TORCH_THREADS": "1",
        },
    )
    await asyncio.to_thread(stack.processes["replica"].wait_ready, 240)

    async def registered():
        return len(await live_replicas(js, PROJECT, MODEL)) == 1

    await wait_for(registered, timeout=30)
    (info,) = await live_replicas(js, PROJECT, MODEL)
    async with openai.AsyncOpenAI(base_url=f"{info.url}/v1", api_key="none") as api:
        yield api


async def take_turn(
    api: openai.AsyncOpenAI, trajectory: art.Trajectory, turns: list[Turn], *, tool_call: bool
) -> None:
    """Sample the next assistant message and append it (a Choice, as agents do). With
    ``tool_call``, seeds are tried until a choice parses as a call; the first such is taken."""
    seeds = CALL_SEEDS if tool_call else [0]
    for seed in seeds:
        response = await api.chat.completions.create(
            model=MODEL,
            messages=trajectory.messages(),
            tools=TOOLS,
            logprobs=True,
            temperature=TEMPERATURE,
            max_tokens=MAX_TOKENS,
            seed=seed,
            n=CALL_CHOICES if tool_call else 1,
        )
        for choice in response.choices:
            if tool_call and not choice.message.tool_calls:
                continue
            turns.append(
                Turn(
                    message_index=len(trajectory.messages_and_choices),
                    prompt=list(response.model_extra["prompt_token_ids"]),
                    sampled=list(choice.model_extra["token_ids"]),
                    logprobs=[entry.logprob for entry in choice.logprobs.content],
                )
            )
            trajectory.messages_and_choices.append(choice)
            return
    raise AssertionError(f"no tool call in {len(seeds) * CALL_CHOICES} samples of {seeds}")


def run_tool_calls(trajectory: art.Trajectory) -> None:
    """The agent executes the last message's calls and answers each with a tool message."""
    (call,) = trajectory.messages_and_choices[-1].message.tool_calls
    assert call.function.name == "add"
    arguments = json.loads(call.function.arguments)
    result = arguments["a"] + arguments["b"]
    trajectory.messages_and_choices.append({"role": "tool", "tool_call_id": call.id, "content": str(result)})


async def play(api: openai.AsyncOpenAI) -> tuple[art.Trajectory, list[Turn]]:
    trajectory = art.Trajectory(
        messages_and_choices=[
            {"role": "system", "content": SYSTEM},
            *WORKED_EXAMPLE,
            {"role": "user", "content": "Call the tool: what is 25 + 17?"},
        ],
        tools=TOOLS,
        reward=1.0,
    )
    turns: list[Turn] = []
    await take_turn(api, trajectory, turns, tool_call=True)
    run_tool_calls(trajectory)
    await take_turn(api, trajectory, turns, tool_call=False)
    trajectory.messages_and_choices.append({"role": "user", "content": "Thanks. And what is 8 + 5?"})
    await take_turn(api, trajectory, turns, tool_call=False)
    return trajectory, turns


def continues(turn: Turn, after: Turn) -> bool:
    """Whether the engine's prompt for ``turn`` starts with ``after``'s prompt and sample."""
    before = after.prompt + after.sampled
    return turn.prompt[: len(before)] == before


async def test_the_trainer_trains_exactly_the_tokens_the_engine_saw_and_sampled(client):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trajectory, turns = await play(client)
    path = resolve_base_model(SMOLLM2)
    tokenizer = AutoTokenizer.from_pretrained(path)  # as the trainer loads it (trainer/lora.py)
    # The engine did the agent's work: a call it wrote and our inference parsed, then answers.
    assert trajectory.messages_and_choices[turns[0].message_index].message.tool_calls
    assert "<tool_call>" in tokenizer.decode(turns[0].sampled)
    assert all(len(t.sampled) == len(t.logprobs) > 0 for t in turns)

    # As a stored trajectory reaches the trainer: wire types, through JSON.
    stored = msgspec.json.decode(msgspec.json.encode(trajectory.to_wire()), type=Trajectory)
    sequences, report = build_sequences([[stored]], [[1.0]], tokenizer, max_seq_len=4096)
    assert not report.dropped and not report.cut

    # Turns share a sequence exactly where the engine's prompt continued the turn before.
    parts: list[list[Turn]] = [[turns[0]]]
    for before, turn in itertools.pairwise(turns):
        if continues(turn, before):
            parts[-1].append(turn)
        else:
            parts.append([turn])
    assert len(sequences) == len(parts) and report.split == len(parts) - 1
    print(  # what the engine did, for the log (-s)
        "turns (prompt, sampled tokens):",
        [(len(t.prompt), len(t.sampled)) for t in turns],
        "sequences (turns each):",
        [len(part) for part in parts],
    )

    for sequence, part in zip(sequences, parts, strict=True):
        last = part[-1]
        # The sequence is the engine's last prompt and sample of the part, token for token...
        assert sequence.input_ids == last.prompt + last.sampled
        expected_mask = [0] * len(sequence.input_ids)
        expected_logprobs = [math.nan] * len(sequence.input_ids)
        for turn in part:
            # ...which starts with each earlier turn's prompt and sample, and trains each sample.
            start, end = len(turn.prompt), len(turn.prompt) + len(turn.sampled)
            assert sequence.input_ids[:end] == turn.prompt + turn.sampled
            expected_mask[start:end] = [1] * len(turn.sampled)
            expected_logprobs[start:end] = turn.logprobs
        # Nothing but sampled tokens is trained: not the system, user or tool messages.
        assert sequence.assistant_mask == expected_mask
        assert [lp for lp, m in zip(sequence.old_logprobs, expected_mask, strict=True) if m] == [
            lp for lp, m in zip(expected_logprobs, expected_mask, strict=True) if m
        ]
        assert all(
            math.isnan(lp) for lp, m in zip(sequence.old_logprobs, expected_mask, strict=True) if not m
        )
    assert sum(sum(s.assistant_mask) for s in sequences) == sum(len(t.sampled) for t in turns)
    trained_text = "".join(
        tokenizer.decode([i for i, m in zip(s.input_ids, s.assistant_mask, strict=True) if m])
        for s in sequences
    )
    assert "Call the tool" not in trained_text and "You can use the tool" not in trained_text

    # The trainer's model scores the trained positions as the engine did: the mask is not shifted.
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    batch = pad_batch(sequences, pad_id=tokenizer.pad_token_id or 0)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits  # [B,T,V]
    logprobs = (logits[:, :-1] / TEMPERATURE).log_softmax(-1)  # [B,T-1,V]
    recomputed = logprobs.gather(-1, batch["input_ids"][:, 1:].unsqueeze(-1)).squeeze(-1)  # [B,T-1]
    trained = batch["assistant_mask"].bool()  # [B,T-1]
    difference = (recomputed[trained] - batch["old_logprobs"][trained]).abs()
    assert difference.max().item() < 0.05, difference.max().item()
