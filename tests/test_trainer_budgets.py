"""A trainer that a stranger's request can neither blow up nor loop on (issue 27, findings 2, 3, 7).

Against a real nats-server and PostgreSQL, with the tiny model: a request over a budget is
refused before a tensor is made, with a ``train.failed`` naming the budget and its figures, and
the trainer serves the next request; a model that cannot be loaded fails at its first delivery,
not after twenty; a record's ``base_model`` never opens a path the agent chose.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import msgspec
import pytest

from artery.schemas import (
    Message,
    Sample,
    TrainCompleted,
    TrainFailed,
    TrainRequested,
    Trajectory,
    TrajectoryGroupSubmitted,
    new_event_id,
)
from artery.services.collector.store import StoredGroup, write_groups
from artery.services.trainer.budgets import BudgetExceeded, ModelShape, StepBudget, check_trajectories
from artery.services.trainer.service import Trainer
from artery.services.trainer.settings import TrainerSettings
from artery.shared import subjects
from artery.shared.bus import publish_event
from artery.shared.models import TINY
from tests.factories import register_trainable
from tests.test_db_faults import MODEL, PROJECT, text_group


def sampled_turns_group(project: str, model: str, turns: int, size: int = 2) -> TrajectoryGroupSubmitted:
    """The finding's case: each trajectory ``turns`` user questions, each answered by one sampled
    token (about 40 KB for 2 x 200)."""

    def trajectory(i: int) -> Trajectory:
        messages = [Message(role="system", content="Answer with one letter.")]
        for turn in range(turns):
            messages.append(Message(role="user", content=f"question {turn}"))
            messages.append(
                Message(role="assistant", content="a", sample=Sample(token_ids=[5 + i], logprobs=[-0.5]))
            )
        return Trajectory(messages=messages, reward=float(i))

    return TrajectoryGroupSubmitted(
        id=new_event_id(), project=project, model=model, trajectories=[trajectory(i) for i in range(size)]
    )


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


@contextlib.asynccontextmanager
async def running_trainer(nc, database_url, settings: TrainerSettings):
    trainer = Trainer(nc, database_url, settings)
    await trainer.start()
    task = asyncio.create_task(trainer.run())
    try:
        yield trainer
    finally:
        trainer.stop()
        await asyncio.wait_for(task, 60)
        await trainer.close()


class Answers:
    """``train.completed`` and ``train.failed`` of a model, by request id, as they arrive."""

    def __init__(self, js, project: str, model: str):
        self.js, self.project, self.model = js, project, model
        self.by_request: dict[str, TrainCompleted | TrainFailed] = {}
        self.order: list[str] = []
        self._subs = []

    async def __aenter__(self):
        for kind, type_ in (("completed", TrainCompleted), ("failed", TrainFailed)):
            subject = subjects.train(kind, self.project, self.model)

            async def received(msg, type_=type_):
                event = msgspec.json.decode(msg.data, type=type_)
                self.by_request[event.request_id] = event
                self.order.append(event.request_id)

            self._subs.append(await self.js.subscribe(subject, cb=received, ordered_consumer=True))
        return self

    async def __aexit__(self, *exc):
        for sub in self._subs:
            await sub.unsubscribe()

    async def of(self, request_id: str, timeout: float = 60.0):
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while request_id not in self.by_request:
            assert loop.time() < deadline, f"no answer to {request_id} within {timeout}s"
            await asyncio.sleep(0.05)
        return self.by_request[request_id]


async def request(js, project: str, model: str, group_ids: list[str]) -> TrainRequested:
    event = TrainRequested(id=new_event_id(), project=project, model=model, group_ids=group_ids)
    await publish_event(js, subjects.train("requested", project, model), event)
    return event


def settings_for(tmp_path, **overrides) -> TrainerSettings:
    return TrainerSettings(
        checkpoint_dir=str(tmp_path / "ckpt"), max_seq_len=128, pause_timeout_s=1.0, **overrides
    )


# --------------------------------------------------------------------------- budgets


async def test_a_trajectory_of_many_sampled_turns_is_refused_at_once_and_the_next_request_trains(
    nc, js, db, database_url, tmp_path
):
    """2 trajectories x 200 sampled one-token turns (~40 KB) once grew a trainer to 17.6 GB; now
    it is a train.failed naming the budget, before the model is even loaded, and the next
    request of the same model trains."""
    await register_trainable(js, PROJECT, MODEL, TINY)
    hostile = sampled_turns_group(PROJECT, MODEL, turns=200)
    assert 30_000 < len(msgspec.json.encode(hostile)) < 60_000
    good = [text_group(seed) for seed in range(2)]
    await write_groups(db, [StoredGroup.of(g, None) for g in [hostile, *good]])
    async with (
        Answers(js, PROJECT, MODEL) as answers,
        running_trainer(nc, database_url, settings_for(tmp_path)),
    ):
        before = rss_bytes()
        refused = await request(js, PROJECT, MODEL, [hostile.id])
        failed = await answers.of(refused.id, timeout=30)
        grown = rss_bytes() - before
        assert isinstance(failed, TrainFailed) and not failed.retriable
        assert "max_sampled_turns" in failed.error and "200 > 64" in failed.error, failed.error
        assert grown < 150 * 2**20, f"RSS grew {grown / 2**20:.0f} MiB on a refused request"

        trained = await request(js, PROJECT, MODEL, [g.id for g in good])
        completed = await answers.of(trained.id)
        assert isinstance(completed, TrainCompleted) and completed.step == 1


async def test_each_budget_names_itself_and_its_figures(nc, js, db, database_url, tmp_path):
    """Requests within the turn budget but over the others: sequences per group and per request,
    tokens per sequence and per request, and the memory estimate, each refused by name."""
    await register_trainable(js, PROJECT, MODEL, TINY)
    groups = [text_group(seed) for seed in range(2)]  # 4 trajectories each, ~20-token sequences
    await write_groups(db, [StoredGroup.of(g, None) for g in groups])
    ids = [g.id for g in groups]
    cases = {
        "max_group_sequences": ({"max_group_sequences": 3}, "group 0: conversations 4 > 3"),
        "max_request_sequences": ({"max_request_sequences": 7}, "conversations of the request 8 > 7"),
        "max_sequence_tokens": ({"max_sequence_tokens": 16}, "tokens of a sequence"),
        "max_request_tokens": ({"max_request_tokens": 40}, "tokens of the request"),
        "max_step_memory_mib": ({"max_step_memory_mib": 1}, "estimated MiB of the largest micro-batch"),
    }
    for budget, (overrides, figures) in cases.items():
        settings = settings_for(tmp_path / budget, **overrides)
        async with Answers(js, PROJECT, MODEL) as answers, running_trainer(nc, database_url, settings):
            refused = await request(js, PROJECT, MODEL, ids)
            failed = await answers.of(refused.id)
        assert isinstance(failed, TrainFailed) and not failed.retriable, (budget, failed)
        assert budget in failed.error and figures in failed.error, (budget, failed.error)
        assert not any((tmp_path / budget / "ckpt" / PROJECT / MODEL).glob("0*")), "a refused step was saved"


async def test_groups_too_large_to_load_are_refused_before_they_are_read(nc, js, db, database_url, tmp_path):
    """Their stored size is asked of PostgreSQL first: 2 MB of trajectories against a 1 MiB budget."""
    await register_trainable(js, PROJECT, MODEL, TINY)
    big = text_group(0)
    for trajectory in big.trajectories:
        trajectory.messages[0].content = "x" * 500_000
    await write_groups(db, [StoredGroup.of(big, None)])
    settings = settings_for(tmp_path, max_request_mib=1)
    async with Answers(js, PROJECT, MODEL) as answers, running_trainer(nc, database_url, settings):
        refused = await request(js, PROJECT, MODEL, [big.id])
        failed = await answers.of(refused.id)
    assert isinstance(failed, TrainFailed) and not failed.retriable
    assert "max_request_mib exceeded: MiB of trajectories 2 > 1" in failed.error, failed.error


async def test_a_request_over_a_budget_never_pauses_inference(nc, js, db, database_url, tmp_path):
    """The sequences are made and measured before the pause: with a registered replica that never
    answers a pause (any pause attempt would fail and be retried), a request over the tokens
    budget is still answered train.failed at once."""
    from artery.schemas import ReplicaInfo

    await register_trainable(js, PROJECT, MODEL, TINY)
    replicas = await js.key_value(subjects.REPLICAS_BUCKET)
    ghost = ReplicaInfo(
        replica_id="ghost", project=PROJECT, model=MODEL, engine="transformers", url="http://x"
    )
    await replicas.put(subjects.replica_key(PROJECT, MODEL, "ghost"), msgspec.json.encode(ghost))
    groups = [text_group(seed) for seed in range(2)]
    await write_groups(db, [StoredGroup.of(g, None) for g in groups])
    settings = settings_for(tmp_path, max_request_tokens=40)
    async with Answers(js, PROJECT, MODEL) as answers, running_trainer(nc, database_url, settings) as trainer:
        refused = await request(js, PROJECT, MODEL, [g.id for g in groups])
        failed = await answers.of(refused.id)
        assert isinstance(failed, TrainFailed) and "max_request_tokens" in failed.error, failed
        assert trainer.consumer.stats.retried == 0  # no pause was tried, none failed


def test_the_budgets_are_checked_from_the_trajectories_alone():
    """The checks before tokenizing need only the stored trajectories (no model, no tensor)."""
    settings = TrainerSettings(max_sampled_turns=3)
    group = sampled_turns_group("p", "m", turns=3).trajectories
    check_trajectories(settings, [group])  # at the budget: accepted
    with pytest.raises(BudgetExceeded, match=r"group 1 trajectory 0: sampled turns 4 > 3"):
        check_trajectories(settings, [group, sampled_turns_group("p", "m", turns=4).trajectories])
    # 20 turns after 60 KB questions each: every turn's prompt renders all before it (~12 MiB).
    long = sampled_turns_group("p", "m", turns=20, size=1).trajectories
    for message in long[0].messages:
        if message.role == "user":
            message.content = "q" * 60_000
    check_trajectories(TrainerSettings(max_rendered_mib=13), [long])
    with pytest.raises(
        BudgetExceeded, match=r"max_rendered_mib exceeded: MiB the chat template renders 13 > 12"
    ):
        check_trajectories(TrainerSettings(max_rendered_mib=12), [long])


def test_the_memory_estimate_grows_with_the_micro_batch_and_refuses_past_its_limit():
    shape = ModelShape(layers=30, hidden=576, intermediate=1536, vocab=49152, bytes_per_value=4)
    assert shape.micro_batch_bytes(8, 250, 20) == 2 * shape.micro_batch_bytes(4, 250, 20)
    assert 2.5e9 < shape.micro_batch_bytes(8, 250, 20) < 3.5e9  # SmolLM2's demo micro-batch
    # Logits only from the first trained position on: a long prompt's positions cost no logits.
    assert shape.micro_batch_bytes(8, 250) - shape.micro_batch_bytes(8, 250, 20) == 8 * 230 * 2 * 49152 * 4
    budget = StepBudget(TrainerSettings(), memory_limit=2**30)

    class Seq(msgspec.Struct):
        input_ids: list[int]
        assistant_mask: list[int]
        group_index: int = 0

    budget.check_sequences([Seq([1] * 100, [0] * 90 + [1] * 10)], 0, shape, 8)  # 0.15 GB: within
    with pytest.raises(BudgetExceeded, match=r"max_step_memory_mib exceeded: estimated MiB .* > 1,024"):
        budget.check_sequences([Seq([1] * 300, [0] * 280 + [1] * 20)] * 8, 0, shape, 8)


# --------------------------------------------------------------------------- deterministic errors


async def test_a_base_model_that_cannot_be_loaded_fails_at_its_first_delivery(
    nc, js, db, database_url, tmp_path
):
    """A model directory without its weights file (allowed: ``*``, as on a bus without
    authentication) is an OSError in from_pretrained: it was retried twenty times as if a
    dependency were down, the trainer busy with it each time; now train.failed at once."""
    import shutil

    from artery.shared.tiny_model import tiny_model_path

    empty = tmp_path / "no-weights"
    shutil.copytree(tiny_model_path(), empty, ignore=shutil.ignore_patterns("*.safetensors"))
    await register_trainable(js, PROJECT, MODEL, str(empty))
    groups = [text_group(seed) for seed in range(2)]
    await write_groups(db, [StoredGroup.of(g, None) for g in groups])
    settings = settings_for(tmp_path, base_models="*")
    async with Answers(js, PROJECT, MODEL) as answers, running_trainer(nc, database_url, settings) as trainer:
        refused = await request(js, PROJECT, MODEL, [g.id for g in groups])
        failed = await answers.of(refused.id)
        assert isinstance(failed, TrainFailed) and not failed.retriable
        assert "OSError" in failed.error and "no-weights" in failed.error, failed.error
        info = await js.consumer_info(subjects.TRAINING.name, "trainer")
        assert trainer.consumer.stats.retried == 0 and info.num_redelivered == 0


# --------------------------------------------------------------------------- base models


async def test_a_record_never_points_the_trainer_at_a_file_or_another_projects_checkpoints(
    nc, js, db, database_url, tmp_path
):
    """``/etc/shadow`` as a base model, or project ``hostile``'s step-5 adapter as ``other``'s warm
    start: refused as not retriable, with either list of base models (the embedded names, or
    ``*`` as on a bus without authentication), and nothing of either is loaded."""
    from artery.services.trainer.policy import Policy

    settings = settings_for(tmp_path)
    # A real adapter where project hostile's step 5 would be: loadable, were it allowed.
    hostile_step = Path(settings.checkpoint_dir) / "hostile" / "agent" / "000005"
    Policy.create(TINY).save(hostile_step)
    groups = [text_group(seed) for seed in range(2)]
    await write_groups(db, [StoredGroup.of(g, None) for g in groups])
    cases = [
        ("someone/their-model", None, "not allowed on this trainer (ARTERY_TRAINER_BASE_MODELS)"),
        ("/etc/shadow", None, "is a path, and not a directory of weights"),
        ("/etc/shadow", "*", "is a path, and not a directory of weights"),
        (str(hostile_step / "adapter"), None, f"is not one of project {PROJECT!r}'s own adapters"),
        (str(hostile_step / "adapter"), "*", f"is not one of project {PROJECT!r}'s own adapters"),
    ]
    for base_model, listed, reason in cases:
        await register_trainable(js, PROJECT, MODEL, base_model)
        case_settings = msgspec.structs.replace(settings, base_models=listed)
        async with Answers(js, PROJECT, MODEL) as answers, running_trainer(nc, database_url, case_settings):
            refused = await request(js, PROJECT, MODEL, [g.id for g in groups])
            failed = await answers.of(refused.id)
        assert isinstance(failed, TrainFailed) and not failed.retriable, (base_model, listed, failed)
        assert reason in failed.error, (base_model, listed, failed.error)
    assert not (Path(settings.checkpoint_dir) / PROJECT).exists()  # nothing trained for it


def test_a_warm_start_is_allowed_from_the_projects_own_adapters_only(tmp_path):
    """Pure rules: the project's own checkpoints and warm-start directory (on a listed base), never
    another project's, nor a link that leads out of its own, nor a name off the list."""
    import json

    from artery.services.trainer.base_models import BaseModelRefused, check_base_model

    def adapter(path: Path, base: str = TINY) -> Path:
        path.mkdir(parents=True)
        (path / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": base}))
        return path

    settings = TrainerSettings(checkpoint_dir=str(tmp_path / "ckpt"), warm_start_dir=str(tmp_path / "warm"))
    check_base_model(settings, "mine", TINY)
    check_base_model(settings, "mine", str(adapter(tmp_path / "warm" / "mine" / "sft")))
    check_base_model(settings, "mine", str(adapter(tmp_path / "ckpt" / "mine" / "m" / "000003" / "adapter")))
    theirs = adapter(tmp_path / "warm" / "theirs" / "sft")
    (tmp_path / "warm" / "mine" / "link").symlink_to(theirs)
    refused = {
        str(theirs): "is not one of project 'mine''s own adapters",
        str(tmp_path / "warm" / "mine" / "link"): "is not one of project 'mine''s own adapters",
        str(
            tmp_path / "warm" / "mine" / ".." / "theirs" / "sft"
        ): "is not one of project 'mine''s own adapters",
        str(adapter(tmp_path / "warm" / "mine" / "odd", base="someone/else")): "which is not allowed",
        str(tmp_path / "elsewhere"): "is a path, and not a directory of weights",
        "Qwen/Qwen3-0.6B": "not allowed on this trainer",
    }
    for base_model, reason in refused.items():
        with pytest.raises(BaseModelRefused, match=reason.replace("(", r"\(")):
            check_base_model(settings, "mine", base_model)
    anything = msgspec.structs.replace(settings, base_models="*")
    check_base_model(anything, "mine", "Qwen/Qwen3-0.6B")
    with pytest.raises(BaseModelRefused, match="own adapters"):
        check_base_model(anything, "mine", str(theirs))
