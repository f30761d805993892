"""Supervised fine-tuning (ART's ``train_sft``): the loss and its masks by hand, the schedule of
learning rates, a redelivered request that trains once, and the tiny model taught three fixed
answers through the real services."""

from __future__ import annotations

import json

import msgspec
import pytest
import torch

import artery as art
from artery.schemas import (
    Message,
    ModelRecord,
    TrainCompleted,
    TrainFailed,
    TrainSFTConfig,
    TrainSFTRequested,
    Trajectory,
    TrajectoryGroupSubmitted,
    new_event_id,
)
from artery.services.trainer.policy import LoraSettings, OptimSettings, Policy, sft_loss
from artery.services.trainer.sequences import pad_batch, sft_sequences
from artery.shared.models import TINY
from artery.shared.tiny_model import tiny_model_path

MAX_SEQ_LEN = 256
#: Three prompts, each with its one answer (words the tiny model's tokenizer knows).
TARGETS = [
    ("what is the weather today?", "the sun is high."),
    ("name a fruit.", "banana."),
    ("count to three.", "one two three."),
]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path())


def conversation(prompt: str, answer: str) -> Trajectory:
    return Trajectory(
        messages=[Message(role="user", content=prompt), Message(role="assistant", content=answer)]
    )


# --------------------------------------------------------------------------- the loss, by hand


def test_sft_loss_is_the_mean_cross_entropy_of_the_masked_tokens():
    logprobs = torch.tensor([[-0.5, -1.0, -2.0, -4.0], [-3.0, -0.25, -1.5, -8.0]])  # [B=2,T-1=4]
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.0, 0.0, 1.0, 1.0]])
    loss = sft_loss(logprobs, mask, num_tokens=4.0)
    assert loss.item() == pytest.approx((1.0 + 2.0 + 1.5 + 8.0) / 4)
    # What lies outside the mask never counts, not even a non-finite value.
    poisoned = logprobs.clone()
    poisoned[0, 0], poisoned[1, 1] = float("-inf"), float("nan")
    assert sft_loss(poisoned, mask, num_tokens=4.0).item() == pytest.approx(loss.item())
    # Micro-batches normalised by the whole batch's tokens add up to the batch's loss.
    parts = [sft_loss(logprobs[i : i + 1], mask[i : i + 1], num_tokens=4.0) for i in range(2)]
    assert sum(p.item() for p in parts) == pytest.approx(loss.item())


def test_sft_loss_gradient_reaches_only_the_masked_positions():
    logprobs = torch.tensor([[-0.5, -1.0, -2.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    sft_loss(logprobs, mask, num_tokens=2.0).backward()
    assert logprobs.grad.tolist() == [[-0.5, 0.0, -0.5]]


def test_sft_sequences_train_the_assistant_turns_only(tokenizer):
    """Every assistant message is trained (no sample needed), ``<|im_end|>`` included; the prompt,
    the template's framing and a message marked ``trainable=False`` are not; the conversation is
    cut after the last trained message."""
    trajectory = Trajectory(
        messages=[
            Message(role="system", content="be brief."),
            Message(role="user", content="name a fruit."),
            Message(role="assistant", content="banana."),
            Message(role="user", content="another one?"),
            Message(role="assistant", content="apple."),
            Message(role="user", content="and a third?"),
            Message(role="assistant", content="orange.", trainable=False),
        ],
        reward=0.0,  # rewards play no part in SFT
    )
    sequences, report = sft_sequences([trajectory], tokenizer, max_seq_len=MAX_SEQ_LEN)
    assert report.counts()["sequences"] == 1 and len(sequences) == 1
    (sequence,) = sequences
    trained = [t for t, m in zip(sequence.input_ids, sequence.assistant_mask, strict=True) if m]
    assert tokenizer.decode(trained) == "banana.<|im_end|>apple.<|im_end|>"
    text = tokenizer.decode(sequence.input_ids)
    assert "orange" not in text and text.rstrip().endswith("apple.<|im_end|>")
    # pad_batch lines the mask up with the predicted tokens, as the GRPO path does.
    batch = pad_batch(sequences, pad_id=tokenizer.pad_token_id)
    assert batch["assistant_mask"].sum().item() == len(trained)


def test_learning_rates_one_per_batch():
    assert TrainSFTConfig().learning_rates(5) == [5e-5] * 3  # "auto": 2 trajectories per batch
    assert TrainSFTConfig(learning_rate=1e-3, batch_size=4).learning_rates(8) == [1e-3, 1e-3]
    assert TrainSFTConfig(learning_rate=[3e-3, 2e-3, 1e-3], batch_size=3).learning_rates(7) == [
        3e-3,
        2e-3,
        1e-3,
    ]
    with pytest.raises(ValueError, match="2 learning rates for 3 batches"):
        TrainSFTConfig(learning_rate=[1e-3, 1e-3], batch_size=3).learning_rates(7)
    for bad in (
        {"learning_rate": []},
        {"learning_rate": [1e-3, 0.0]},
        {"learning_rate": -1},
        {"batch_size": 0},
    ):
        with pytest.raises(msgspec.ValidationError):
            msgspec.convert(bad, TrainSFTConfig)


async def test_the_sdk_refuses_a_schedule_without_one_rate_per_batch_before_publishing():
    backend = art.Backend(nats_url="nats://127.0.0.1:1")  # never connected: it fails first
    model = art.TrainableModel(name="sft", project="unit", base_model=TINY)
    trajectories = [
        art.Trajectory(
            messages_and_choices=[{"role": "user", "content": p}, {"role": "assistant", "content": a}]
        )
        for p, a in TARGETS
    ]
    with pytest.raises(ValueError, match="3 learning rates for 2 batches"):
        await backend.train_sft(
            model, trajectories, art.TrainSFTConfig(learning_rate=[1e-3] * 3, batch_size=2)
        )
    with pytest.raises(ValueError, match="at least one trajectory"):
        await backend.train_sft(model, [])


def test_sft_step_reports_the_cross_entropy_of_the_answer_and_lowers_it(single_torch_thread):
    """The step's loss (taken before its update) is the model's mean cross-entropy over the
    answer's tokens and ``<|im_end|>``, computed here with the model itself; each batch gets its
    own learning rate; the loss falls."""
    policy = Policy.create(tiny_model_path(), LoraSettings(), OptimSettings(), seed=0)
    prompt, answer = TARGETS[1]
    tok = policy.tokenizer
    prompt_ids = list(
        tok.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_dict=False
        )
    )
    answer_ids = [*tok.encode(answer, add_special_tokens=False), tok.convert_tokens_to_ids("<|im_end|>")]
    with torch.no_grad():
        logits = policy.model(input_ids=torch.tensor([prompt_ids + answer_ids])).logits[0]  # [T,V]
    logprobs = torch.log_softmax(logits[len(prompt_ids) - 1 : -1].float(), -1)  # [n,V]
    expected = -logprobs.gather(-1, torch.tensor(answer_ids)[:, None]).mean().item()

    trajectories = [conversation(prompt, answer)] * 4
    config = TrainSFTConfig(learning_rate=[4e-3, 2e-3], batch_size=4)  # one batch: one rate, 2 raise
    with pytest.raises(ValueError, match="2 learning rates for 1 batches"):
        policy.sft_step(trajectories, config, max_seq_len=MAX_SEQ_LEN)
    assert policy.step == 0  # refused before anything happened

    first = policy.sft_step(
        trajectories, TrainSFTConfig(learning_rate=[4e-3], batch_size=4), max_seq_len=MAX_SEQ_LEN
    )
    assert first.trained and first.step == 1
    assert first.metrics["loss"] == pytest.approx(expected, rel=1e-4)
    assert first.metrics["tokens_trained"] == 4 * len(answer_ids)
    assert first.metrics["learning_rate"] == pytest.approx(4e-3)
    assert first.metrics["batches"] == 1 and first.metrics["optimizer_steps"] == 1
    assert policy.optimizer.param_groups[0]["lr"] == pytest.approx(4e-3)

    second = policy.sft_step(
        trajectories, TrainSFTConfig(learning_rate=[3e-3, 1e-3], batch_size=2), max_seq_len=MAX_SEQ_LEN
    )
    assert second.step == 2 and second.metrics["optimizer_steps"] == 2
    assert second.metrics["learning_rate"] == pytest.approx(2e-3)  # the mean of the schedule
    assert policy.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3)  # the last batch's
    assert second.metrics["loss"] < first.metrics["loss"]


# --------------------------------------------------------------------------- the trainer service


async def test_a_redelivered_sft_request_trains_once(
    nc, js, db, database_url, tmp_path, monkeypatch, single_torch_thread
):
    """The same request handled twice (a redelivery) trains one step and answers it twice; a
    schedule that does not fit the stored trajectories is answered with a final train.failed."""
    from artery.services.collector.store import StoredGroup, write_groups
    from artery.services.trainer.service import Trainer
    from artery.services.trainer.settings import TrainerSettings
    from artery.shared import subjects
    from tests.factories import register_trainable

    project, model = "sft", "agent"
    calls: list[int] = []
    real_sft_step = Policy.sft_step

    def counting_sft_step(self, trajectories, *args, **kwargs):
        calls.append(len(trajectories))
        return real_sft_step(self, trajectories, *args, **kwargs)

    monkeypatch.setattr(Policy, "sft_step", counting_sft_step)
    await register_trainable(js, project, model, TINY)
    groups = [
        TrajectoryGroupSubmitted(
            id=new_event_id(),
            project=project,
            model=model,
            trajectories=[conversation(p, a) for p, a in TARGETS],
        )
        for _ in range(2)
    ]
    await write_groups(db, [StoredGroup.of(g, None) for g in groups])
    request = TrainSFTRequested(
        id=new_event_id(),
        project=project,
        model=model,
        group_ids=[g.id for g in groups],
        config=TrainSFTConfig(learning_rate=1e-3, batch_size=3),
    )
    trainer = Trainer(
        nc,
        database_url,
        TrainerSettings(checkpoint_dir=str(tmp_path / "ckpt"), max_seq_len=128, pause_timeout_s=1.0),
    )
    await trainer.start()
    try:
        first = await trainer.handle(request)
        again = await trainer.handle(request)  # the redelivery
        misfit = TrainSFTRequested(
            id=new_event_id(),
            project=project,
            model=model,
            group_ids=[groups[0].id],
            config=TrainSFTConfig(learning_rate=[1e-3, 1e-3], batch_size=3),  # 3 trajectories: 1 batch
        )
        failed = await trainer.handle(misfit)
    finally:
        await trainer.close()
    assert isinstance(first, TrainCompleted) and isinstance(again, TrainCompleted)
    assert (first.step, again.step) == (1, 1) and first.id == again.id and again.request_id == request.id
    assert first.metrics["trained"] == 1.0 and first.metrics["batches"] == 2.0
    assert calls == [6]  # trained once, on both groups' trajectories
    rows = await db.fetch("SELECT request_id, step FROM training_steps")
    assert [(r["request_id"], r["step"]) for r in rows] == [(request.id, 1)]
    entry = await (await js.key_value(subjects.MODELS_BUCKET)).get(subjects.model_key(project, model))
    assert msgspec.json.decode(entry.value, type=ModelRecord).step == 1
    assert isinstance(failed, TrainFailed) and not failed.retriable
    assert "2 learning rates for 1 batches" in failed.error


# --------------------------------------------------------------------------- through every service


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_train_sft_teaches_the_tiny_model_three_answers(tmp_path):
    """``model.train_sft`` through collector, trainer, publisher and an inference replica: the
    step advances on every call, and within a few calls greedy decoding through the
    OpenAI-compatible endpoint gives each prompt's answer."""
    backend = art.LocalBackend(path=tmp_path / "artery")
    model = art.TrainableModel(name="sft", project="e2e", base_model=TINY)
    # Each call: every prompt 8 times, 3 trajectories (one of each) per update.
    trajectories = [
        art.Trajectory(
            messages_and_choices=[{"role": "user", "content": p}, {"role": "assistant", "content": a}]
        )
        for p, a in TARGETS
    ] * 8
    config = art.TrainSFTConfig(learning_rate=5e-3, batch_size=3)

    async def greedy() -> list[str]:
        client = model.openai_client()
        answers = []
        for prompt, _ in TARGETS:
            response = await client.chat.completions.create(
                model=model.name, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=12
            )
            answers.append((response.choices[0].message.content or "").strip())
        return answers

    try:
        await model.register(backend)
        before = await greedy()
        assert before != [a for _, a in TARGETS]
        answers: list[list[str]] = []
        for call in range(1, 11):
            result = await model.train_sft(trajectories, config)
            assert result.step == call and await model.get_step() == call
            assert result.metrics["trained"] == 1.0 and result.metrics["batches"] == 8.0
            answers.append(await greedy())
            if answers[-1] == [a for _, a in TARGETS]:
                break
        print("greedy answers per call:", answers)
        assert answers[-1] == [a for _, a in TARGETS], answers
        rows = [json.loads(line) for line in (model.directory / "history.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == list(range(1, len(answers) + 1))
        assert all("train/loss" in r and "train/tokens_trained" in r for r in rows)
        assert rows[-1]["train/loss"] < rows[0]["train/loss"]
    finally:
        await backend.close()
