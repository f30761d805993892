"""The demo-agent's loop: an ordinary OpenAI tools loop against the model's endpoint.

Each turn sends the conversation with ``tools=TOOLS`` and ``logprobs=True``; the inference service
parses the model's Hermes ``<tool_call>{...}</tool_call>`` blocks into ``tool_calls``; the agent
runs each call and appends a ``role="tool"`` message; an answer without calls ends the episode.
The trajectory keeps every turn's ``Choice`` (sampled token ids and logprobs), so the trainer
trains on each assistant turn exactly as sampled.

Two things the prompt does for small models, whatever their chat template makes of ``tools``:

- the system message describes the tool and the call format (SmolLM2's template does not render
  ``tools``; a template that does shows them twice, which does no harm);
- an assistant turn that called a tool goes back to the model with the call written out in that
  format as its content (SmolLM2's template drops ``tool_calls``, so the model would otherwise
  see an empty turn before the tool's result). The trajectory holds that turn as it went back:
  the ``Choice`` with the written-out call as its content and no ``tool_calls``, its sampled
  tokens and logprobs kept. The trainer renders each later turn's prompt from the stored messages,
  so they must be what the model was sent (``tests/test_demo_agent.py`` checks it).
"""

from __future__ import annotations

import json
from typing import Any

import artery as art
from artery.demos.demo_agent.task import TOOL_NAME, TOOLS, Episode, Question, reward, reward_parts, run_tool

SYSTEM = (
    f"You can use one tool, {TOOL_NAME}, which evaluates arithmetic. To use it, reply with only:\n"
    "<tool_call>\n"
    f'{{"name": "{TOOL_NAME}", "arguments": {{"expression": "<arithmetic>"}}}}\n'
    "</tool_call>\n"
    "The result comes back in a tool message. Then reply with the final number only."
)

#: One worked example per kind of question: the whole exchange, as the model should do it.
EXAMPLES: dict[str, tuple[str, str, int]] = {
    "times": ("What is 25 * 4?", "25 * 4", 100),
    "words": ("A bag holds 25 marbles. How many marbles are in 4 bags?", "25 * 4", 100),
    "convert": ("How many grams are in 4 kilograms?", "4 * 1000", 4000),
}


def call_text(name: str, arguments: Any) -> str:
    """A call as the model writes it (the Hermes format the system message shows)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass  # the model's own (invalid) JSON text, kept as a string
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def prompt(question: Question, example: bool = True) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    if example:
        text, expression, result = EXAMPLES[question.kind]
        messages += [
            {"role": "user", "content": text},
            {"role": "assistant", "content": call_text(TOOL_NAME, {"expression": expression})},
            {"role": "tool", "tool_call_id": "call_example", "content": json.dumps({"result": result})},
            {"role": "assistant", "content": str(result)},
        ]
    messages.append({"role": "user", "content": question.text})
    return messages


async def rollout(
    model: art.TrainableModel,
    question: Question,
    *,
    max_tokens: int = 48,
    max_turns: int = 3,
    temperature: float = 1.0,
    seed: int | None = None,
    inference_name: str | None = None,
    example: bool = True,
) -> art.Trajectory:
    """One episode; the reward and its parts (``task.reward_parts``), turns and calls as metrics."""
    client = model.openai_client()
    name = inference_name or model.get_inference_name()
    history = prompt(question, example)
    trajectory = art.Trajectory(
        messages_and_choices=list(history),
        tools=TOOLS,
        metadata={"question": question.text, "answer": question.answer, "kind": question.kind},
    )
    episode = Episode()
    calls = 0
    while episode.turns < max_turns:
        extra = {} if seed is None else {"seed": seed + episode.turns}
        response = await client.chat.completions.create(
            model=name,
            messages=history,
            tools=TOOLS,
            max_tokens=max_tokens,
            temperature=temperature,
            logprobs=True,
            **extra,
        )
        episode.turns += 1
        choice = response.choices[0]
        tool_calls = choice.message.tool_calls or []
        if not tool_calls:
            trajectory.messages_and_choices.append(choice)
            # An answer cut off by the token limit is no answer.
            episode.final = (choice.message.content or "") if choice.finish_reason == "stop" else None
            break
        written = [call_text(c.function.name, c.function.arguments) for c in tool_calls]
        content = "\n".join(filter(None, [choice.message.content, *written]))
        history.append({"role": "assistant", "content": content})
        # The trajectory keeps the turn as it went back to the model (the call written out), with
        # its sampled tokens: the trainer renders the next turn's prompt from the stored messages,
        # and it must be the prompt the engine saw, not one with an empty assistant turn (SmolLM2's
        # template drops tool_calls).
        sent_back = choice.message.model_copy(update={"content": content, "tool_calls": None})
        trajectory.messages_and_choices.append(choice.model_copy(update={"message": sent_back}))
        for call in tool_calls:
            result = run_tool(call.function.name, call.function.arguments)
            calls += 1
            episode.calls.append(result)
            message = {"role": "tool", "tool_call_id": call.id, "content": result.content}
            history.append(message)
            trajectory.messages_and_choices.append(message)
    trajectory.reward = reward(episode, question.answer)
    trajectory.metrics.update(
        reward_parts(episode, question.answer),
        turns=episode.turns,
        tool_calls=calls,
        valid_calls=sum(c.valid for c in episode.calls),
    )
    trajectory.metadata["final"] = episode.final if episode.final is not None else ""
    return trajectory.finish()
