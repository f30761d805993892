"""Every completion is trainable, and a step that trains nothing says so.

ART's server forces ``logprobs=True`` on every request, so ART's agents never ask for them. Against
Artery's inference service with the tiny model:

- a completion for which the client did not ask logprobs has OpenAI's standard shape (no
  ``logprobs`` content) yet carries the sampled tokens' ids and logprobs as extra fields, and a
  trajectory built from its choice trains on exactly those tokens; streamed, and through litellm,
  too;
- a step with nothing to train (equal rewards, a group of one, every sequence dropped) is reported
  to the caller with its reason, and advances the step as ART's does.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest

import artery as art
from artery.auto_trajectory import auto_trajectory, capture_auto_trajectory
from artery.backend_api import untrained_reason

PROMPT = [{"role": "user", "content": "Say a letter."}]


async def _plain_trajectory(model: art.TrainableModel, reward: float) -> tuple[art.Trajectory, Any]:
    """ART's way: the choice appended as it came back, no ``logprobs`` asked for."""
    client = model.openai_client()
    raw = await client.chat.completions.with_raw_response.create(
        model=model.get_inference_name(), messages=PROMPT, max_tokens=5
    )
    body = json.loads(raw.text)
    completion = raw.parse()
    choice = completion.choices[0]
    trajectory = art.Trajectory(messages_and_choices=[*PROMPT, choice], reward=reward)
    return trajectory, body


async def _streamed_agent(model: art.TrainableModel, reward: float, seen: list[Any]) -> None:
    client = model.openai_client()
    chunks = await client.chat.completions.create(
        model=model.get_inference_name(), messages=PROMPT, max_tokens=5, stream=True
    )
    seen.extend([chunk async for chunk in chunks])
    auto_trajectory(required=True).reward = reward


async def _litellm_trajectory(model: art.TrainableModel, reward: float) -> art.Trajectory:
    """litellm's ``Choices`` appended as it came back (it keeps Artery's extra fields elsewhere)."""
    import litellm

    response = await litellm.acompletion(**model.litellm_completion_params(), messages=PROMPT, max_tokens=5)
    choice = response.choices[0]
    assert getattr(choice, "logprobs", None) is None
    return art.Trajectory(messages_and_choices=[*PROMPT, choice], reward=reward)


def _sample_of_last_turn(trajectory: art.Trajectory):
    wire = trajectory.to_wire()
    assert wire.messages[-1].role == "assistant"
    return wire.messages[-1].sample


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_completions_without_logprobs_train_and_an_empty_step_says_why(tmp_path, caplog):
    from artery.shared.models import TINY

    backend = art.LocalBackend(path=tmp_path / "artery")
    model = art.TrainableModel(name="plain", project="trainable", base_model=TINY)
    try:
        await model.register(backend)

        # Not asked: the standard shape, and the sample in extra fields.
        plain = [await _plain_trajectory(model, reward) for reward in (0.0, 1.0)]
        for trajectory, body in plain:
            raw_choice = body["choices"][0]
            assert raw_choice["logprobs"] is None
            choice = trajectory.messages_and_choices[-1]
            assert choice.logprobs is None
            ids, logprobs = choice.model_extra["token_ids"], choice.model_extra["token_logprobs"]
            assert ids and len(ids) == len(logprobs) == body["usage"]["completion_tokens"]
            assert all(lp <= 0.0 for lp in logprobs)
            sample = _sample_of_last_turn(trajectory)
            assert sample is not None and sample.token_ids == ids and sample.logprobs == logprobs

        # Streamed, not asked: no chunk has logprobs content; the capture keeps the sample.
        streamed: list[art.Trajectory] = []
        for reward in (0.0, 1.0):
            chunks: list[Any] = []
            streamed.append(await capture_auto_trajectory(_streamed_agent(model, reward, chunks)))
            assert all(c.choices[0].logprobs is None for c in chunks if c.choices)
            chunk_ids = [
                i for c in chunks if c.choices for i in c.choices[0].model_extra.get("token_ids") or []
            ]
            sample = _sample_of_last_turn(streamed[-1])
            assert sample is not None and sample.token_ids == chunk_ids
            assert len(sample.logprobs) == len(chunk_ids)

        # Asked: the standard entries, and the extra field agrees with them.
        asked = await model.openai_client().chat.completions.create(
            model=model.get_inference_name(), messages=PROMPT, max_tokens=5, logprobs=True
        )
        entries = asked.choices[0].logprobs.content
        assert [e.logprob for e in entries] == asked.choices[0].model_extra["token_logprobs"]

        through_litellm = [await _litellm_trajectory(model, reward) for reward in (0.0, 1.0)]
        for trajectory in through_litellm:
            sample = _sample_of_last_turn(trajectory)
            assert sample is not None and sample.token_ids and len(sample.token_ids) == len(sample.logprobs)

        groups = [
            art.TrajectoryGroup(t for t, _ in plain),
            art.TrajectoryGroup(streamed),
            art.TrajectoryGroup(through_litellm),
        ]
        sampled = sum(len(_sample_of_last_turn(t).token_ids) for group in groups for t in group)
        with caplog.at_level(logging.WARNING, logger="artery.backend"):
            result = await model.train(groups, config=art.TrainConfig(learning_rate=1e-3))
        assert result.trained and result.skip_reason is None
        assert result.metrics["tokens_trained"] == sampled > 0
        assert result.metrics["trajectories_used"] == 6 and result.metrics["groups_trained"] == 3
        assert not [r for r in caplog.records if "trained nothing" in r.getMessage()]

        # Equal rewards, and a group of one: nothing to learn, said loudly; the step advances (ART).
        same = [(await _plain_trajectory(model, 0.5))[0] for _ in range(3)]
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="artery.backend"):
            skipped = await model.train([art.TrajectoryGroup(same[:2]), art.TrajectoryGroup(same[2:])])
        assert not skipped.trained and skipped.metrics["tokens_trained"] == 0
        assert "every group was skipped" in skipped.skip_reason
        assert "1 with equal rewards" in skipped.skip_reason
        assert "1 with fewer than two trajectories" in skipped.skip_reason
        assert skipped.step == 2 and await model.get_step() == 2
        (warning,) = [r for r in caplog.records if "trained nothing" in r.getMessage()]
        assert warning.levelno == logging.WARNING and skipped.skip_reason in warning.getMessage()

        # Rewards vary, but no turn carries a sample (text copies of the answers): every sequence
        # is dropped, and the reason names it.
        copies = [
            art.Trajectory(
                messages_and_choices=[*PROMPT, {"role": "assistant", "content": t.messages()[-1]["content"]}],
                reward=t.reward,
            )
            for t, _ in plain
        ]
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="artery.backend"):
            dropped = await model.train([art.TrajectoryGroup(copies)])
        assert not dropped.trained and dropped.metrics["tokens_trained"] == 0
        assert "every sequence was dropped (2)" in dropped.skip_reason
        assert "no_trainable_message: 2" in dropped.skip_reason
        assert dropped.step == 3
        assert [r for r in caplog.records if dropped.skip_reason in r.getMessage()]
    finally:
        await backend.close()


def test_the_reason_of_an_empty_step_is_read_from_the_trainers_counters():
    """The reasons the trainer has besides skipped groups and dropped sequences."""
    assert untrained_reason({"trained": 0.0, "groups": 2.0, "tokens_trained": 12.0}) == (
        "the gradient was not finite, so the optimizer step was not applied"
    )
    stale = {"trained": 0.0, "groups": 0.0, "tokens_trained": 0.0, "offpolicy/trajectories_dropped": 4.0}
    assert untrained_reason(stale) == (
        "no trajectory was left: 4 trajectories dropped as too far off-policy (max_steps_off_policy)"
    )
    # A zero-advantage drop is the equal-rewards skip, not a lost sequence.
    skipped = {
        "trained": 0.0,
        "groups": 1.0,
        "groups_skipped_equal_rewards": 1.0,
        "dropped/zero_advantage": 2.0,
    }
    assert untrained_reason(skipped).startswith("every group was skipped: of 1, 1 with equal rewards")
