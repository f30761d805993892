"""Trajectories, as an agent records them, and the group event agents publish.

Messages follow OpenAI's chat format, so a publisher in any language can send what its chat
client already has. An assistant message that the inference engine sampled carries a ``sample``
with the exact token ids and logprobs, so training uses what was sampled rather than a
re-tokenisation (ART's ``Choice``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from artery.schemas.base import Event, Split, Step, Struct

#: A vocabulary index: tokenizers' ids are non-negative 32-bit integers.
TokenId = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]
Role = Literal["system", "developer", "user", "assistant", "tool", "function"]
JSONObject = dict[str, Any]
Scalar = str | int | float | bool | None


class TextPart(Struct, kw_only=True, tag_field="type", tag="text"):
    text: str


class ImageURL(Struct, kw_only=True):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(Struct, kw_only=True, tag_field="type", tag="image_url"):
    image_url: ImageURL


ContentPart = TextPart | ImagePart


class FunctionCall(Struct, kw_only=True):
    name: str
    #: JSON-encoded arguments, as the model wrote them (they may be invalid JSON: that is data).
    arguments: str


class ToolCall(Struct, kw_only=True):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class TopLogprob(Struct, kw_only=True):
    token: str
    logprob: float
    token_id: TokenId | None = None


class Sample(Struct, kw_only=True):
    """What the engine sampled for one assistant message; present only on engine output."""

    token_ids: list[TokenId]
    logprobs: list[float]
    #: The alternatives at each position, when ``top_logprobs`` was asked for.
    top_logprobs: list[list[TopLogprob]] | None = None
    finish_reason: str | None = None
    #: The model name the engine served it under (``name@step``).
    served_model: str | None = None


class Message(Struct, kw_only=True):
    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    #: Reasoning text some models return beside the content.
    reasoning_content: str | None = None
    sample: Sample | None = None
    #: Whether this assistant message is trained on. Unset means: trained when it has a sample.
    trainable: bool | None = None


class FunctionDefinition(Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: JSONObject | None = None
    strict: bool | None = None


class Tool(Struct, kw_only=True):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class History(Struct, kw_only=True):
    """Another conversation of the same rollout (a sub-agent, a branch); same advantage."""

    messages: list[Message]
    tools: list[Tool] | None = None


# Rewards are plain floats here; the collector rejects NaN, infinities and magnitudes beyond
# ``shared.contract.REWARD_LIMIT`` (1e6) with a reason (msgpack can carry non-finite numbers, and JSON
# Schema cannot express "finite").
class Trajectory(Struct, kw_only=True):
    messages: Annotated[list[Message], msgspec.Meta(min_length=1)]
    tools: list[Tool] | None = None
    additional_histories: list[History] = []
    reward: float = 0.0
    initial_policy_version: Step | None = None
    final_policy_version: Step | None = None
    metrics: dict[str, float | int | bool] = {}
    metadata: dict[str, Scalar] = {}
    logs: list[str] = []


class TrajectoryException(Struct, kw_only=True):
    """A rollout that raised instead of returning a trajectory; kept for the exception rate."""

    type: str
    message: str
    traceback: str | None = None


class RulerSpec(Struct, kw_only=True):
    """Ask the reward service to rank the group with an LLM judge (RULER)."""

    judge_model: str | None = None
    rubric: str | None = None
    #: Keep the agent's own reward and add the judge's, instead of replacing it.
    combine_with_reward: bool = False


class RewardSpec(Struct, kw_only=True):
    ruler: RulerSpec | None = None


class TrajectoryGroupSubmitted(Event, kw_only=True, tag="trajectory_group"):
    """A group of rollouts of the same input: the unit GRPO compares within."""

    trajectories: Annotated[list[Trajectory], msgspec.Meta(min_length=1)]
    exceptions: list[TrajectoryException] = []
    metadata: dict[str, Scalar] = {}
    metrics: dict[str, float | int | bool] = {}
    logs: list[str] = []
    #: ``train`` groups feed the trainer; any other split (``val``) is stored and reported only.
    split: Split = "train"
    #: How the group is to be rewarded; unset means the agent's rewards are final.
    reward: RewardSpec | None = None
