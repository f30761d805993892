"""The trainer renders prompts with the model's chat-template variables, as inference did.

The SDK sends the model's ``chat_template_kwargs`` (ART's ``InternalModelConfig``) with every
completion request, so inference renders the sampled turns' prompts with them; a trainer that
rendered without them would train each turn on a prompt the model never saw (Qwen3's
``enable_thinking``, say), silently. The real rendering with variables is tested in
``tests/test_sequences.py``; this is the hand-off from the model's record to both kinds of step.
"""

from __future__ import annotations

from types import SimpleNamespace

from artery.schemas import ModelRecord, TrainRequested, TrainSFTRequested, new_event_id
from artery.services.trainer.service import Trainer
from artery.services.trainer.settings import TrainerSettings
from artery.services.trainer.torch_thread import TorchThread


class RecordingPolicy:
    def __init__(self):
        self.calls: list[tuple[str, dict]] = []

    def train_step(self, groups, config, **kwargs):
        self.calls.append(("grpo", kwargs))
        return "result"

    def sft_step(self, trajectories, config, **kwargs):
        self.calls.append(("sft", kwargs))
        return "result"


async def test_both_kinds_of_step_render_with_the_models_template_variables():
    variables = {"enable_thinking": False}
    record = ModelRecord(
        project="p", name="m", base_model="b", trainable=True, chat_template_kwargs=variables
    )
    # The steps run on the policies' torch thread (torch_thread.py), as in the service.
    thread = TorchThread()
    trainer = SimpleNamespace(
        settings=TrainerSettings(max_seq_len=128), policies=SimpleNamespace(thread=thread)
    )
    policy = RecordingPolicy()
    try:
        for request in (
            TrainRequested(id=new_event_id(), project="p", model="m", group_ids=[new_event_id()]),
            TrainSFTRequested(id=new_event_id(), project="p", model="m", group_ids=[new_event_id()]),
        ):
            result, _ = await Trainer._step(trainer, policy, 0, request, record, [[]])
            assert result == "result"
    finally:
        thread.close()
    assert [(kind, kwargs["chat_template_kwargs"]) for kind, kwargs in policy.calls] == [
        ("grpo", variables),
        ("sft", variables),
    ]
