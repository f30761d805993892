"""The contract's number rule, shared by the collector and the SDK: finite numbers everywhere.

msgpack carries NaN and infinities, and stored as JSON they would come back as null; a reward
beyond ``REWARD_LIMIT`` would overflow sums and variances. The collector dead-letters a group that
breaks the rule; the SDK checks the same before sending, so the agent hears of it at once.
"""

from __future__ import annotations

import math
from typing import Any

from artery.schemas import History, Trajectory, TrajectoryGroupSubmitted
from artery.shared import codec
from artery.shared.codec import json_leaves
from artery.shared.errors import InvalidMessage

#: The largest reward magnitude a trajectory may carry. Far beyond any sensible reward scale; it
#: keeps sums, means and variances finite (two rewards of 1.8e308 already sum to infinity).
REWARD_LIMIT = 1e6


def check_finite(group: TrajectoryGroupSubmitted) -> None:
    """NaN and infinities would poison every mean and every advantage downstream; stored as
    JSON they would come back as null. Rewards must also lie within ``REWARD_LIMIT``."""
    for i, trajectory in enumerate(group.trajectories):
        if not math.isfinite(trajectory.reward):
            raise InvalidMessage(
                "non_finite",
                f"trajectories[{i}].reward is {trajectory.reward}",
                original_id=group.id,
            )
        if abs(trajectory.reward) > REWARD_LIMIT:
            raise InvalidMessage(
                "out_of_range",
                f"trajectories[{i}].reward is {trajectory.reward}, beyond the limit of ±{REWARD_LIMIT:g}",
                original_id=group.id,
            )
        _check_finite_values(trajectory.metrics, f"trajectories[{i}].metrics", group.id)
        _check_finite_values(trajectory.metadata, f"trajectories[{i}].metadata", group.id)
        _check_conversation(trajectory, f"trajectories[{i}]", group.id)
        for h, history in enumerate(trajectory.additional_histories):
            _check_conversation(history, f"trajectories[{i}].additional_histories[{h}]", group.id)
    _check_finite_values(group.metrics, "metrics", group.id)
    _check_finite_values(group.metadata, "metadata", group.id)


def _check_conversation(conversation: Trajectory | History, where: str, group_id: str) -> None:
    """A conversation's tools and samples (the trajectory's own, or an additional history's)."""
    for t, tool in enumerate(conversation.tools or ()):
        _check_finite_tree(tool.function.parameters, f"{where}.tools[{t}]", group_id)
    for m, message in enumerate(conversation.messages):
        for c, call in enumerate(message.tool_calls or ()):
            if codec.json_nesting_exceeds(call.function.arguments):
                raise InvalidMessage(
                    "validation",
                    f"{where}.messages[{m}].tool_calls[{c}].function.arguments nests deeper than "
                    f"the limit of {codec.MAX_NESTING}",
                    original_id=group_id,
                )
        sample = message.sample
        if sample is None:
            continue
        at = f"{where}.messages[{m}].sample"
        if len(sample.token_ids) != len(sample.logprobs):
            raise InvalidMessage(
                "validation",
                f"{at}: {len(sample.token_ids)} token ids but {len(sample.logprobs)} logprobs",
                original_id=group_id,
            )
        if not all(map(math.isfinite, sample.logprobs)):
            raise InvalidMessage("non_finite", f"{at}.logprobs has a non-finite value", original_id=group_id)
        if sample.top_logprobs is not None and not all(
            math.isfinite(alt.logprob) for position in sample.top_logprobs for alt in position
        ):
            raise InvalidMessage(
                "non_finite", f"{at}.top_logprobs has a non-finite value", original_id=group_id
            )


def _check_finite_values(values: dict, where: str, group_id: str) -> None:
    for key, value in values.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise InvalidMessage("non_finite", f"{where}[{key!r}] is {value}", original_id=group_id)


def _check_finite_tree(value: Any, where: str, group_id: str) -> None:
    """Free-form JSON (a tool's parameter schema): every float in it, however deep."""
    for leaf in json_leaves(value):
        if isinstance(leaf, float) and not math.isfinite(leaf):
            raise InvalidMessage("non_finite", f"{where} holds {leaf}", original_id=group_id)
