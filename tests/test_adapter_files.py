"""A policy's adapter files, built from its parameters after the first save, are PEFT's bytes;
where they would not be, every save goes through PEFT."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from artery.schemas import ModelRecord
from artery.services.trainer.adapter_files import CONFIG, WEIGHTS, AdapterFiles
from artery.services.trainer.checkpoints import PolicyCache
from artery.services.trainer.policy import Policy
from artery.services.trainer.settings import TrainerSettings
from artery.shared.models import TINY


def through_peft(policy: Policy, tmp_path: Path) -> list[tuple[str, bytes]]:
    target = tmp_path / f"peft-{len(list(tmp_path.iterdir()))}"
    policy._save_adapter(target)
    return [(path.name, path.read_bytes()) for path in sorted(target.iterdir())]


def nudge(policy: Policy, by: float) -> None:
    with torch.no_grad():
        for _, param in policy.named_trainable:
            param.add_(by)


def test_after_the_first_save_the_files_are_built_here_and_stay_peft_s(tmp_path):
    policy = Policy.create(TINY)
    first = policy.adapter_files()
    assert policy._adapter_files.built_here
    assert first == through_peft(policy, tmp_path) and [n for n, _ in first] == [CONFIG, WEIGHTS]
    nudge(policy, 0.25)  # the weights change; the files built here follow them
    second = policy.adapter_files()
    assert second != first and second == through_peft(policy, tmp_path)


async def test_a_policy_on_a_shared_base_saves_what_peft_saves_for_its_adapter(tmp_path):
    """With two models' adapters on one base, each policy's files are its own adapter's, under
    the keys a policy of its own would save."""
    settings = TrainerSettings(checkpoint_dir=str(tmp_path / "ckpt"), lora_slots=2, base_model_slots=1)
    cache = PolicyCache(settings)
    a, _ = await cache.get(ModelRecord(project="p", name="a", base_model=TINY, trainable=True))
    b, _ = await cache.get(ModelRecord(project="p", name="b", base_model=TINY, trainable=True))
    assert a.model is b.model and b.adapter_name != a.adapter_name
    for policy, by in ((a, 0.5), (b, -0.5)):
        policy.adapter_files()
        nudge(policy, by)
    files = {policy.adapter_name: policy.adapter_files() for policy in (a, b)}
    assert a._adapter_files.built_here and b._adapter_files.built_here
    assert files[a.adapter_name] != files[b.adapter_name]
    for policy in (a, b):
        assert files[policy.adapter_name] == through_peft(policy, tmp_path)


class ScriptedPeft:
    """A stand-in for PEFT's save: writes ``saved`` (and a model card with ``card``), counting calls."""

    def __init__(self, saved: dict[str, torch.Tensor], card: bool = False) -> None:
        self.saved, self.card, self.calls = saved, card, 0

    def save(self, directory: Path) -> None:
        from artery.services.trainer.tensor_bytes import safetensors_bytes

        self.calls += 1
        (directory / CONFIG).write_text('{"peft_type": "LORA"}')
        (directory / WEIGHTS).write_bytes(safetensors_bytes(self.saved, {"format": "pt"}))
        if self.card:
            (directory / "README.md").write_text("a card")


def test_a_save_that_cannot_be_built_here_always_goes_through_peft():
    weight = torch.ones(2, 3)
    for case, peft in {
        "another file": ScriptedPeft({"w": weight}, card=True),
        "a tensor not trained": ScriptedPeft({"w": weight, "o": torch.zeros(4)}),
    }.items():
        files = AdapterFiles(peft.save, lambda peft=peft: peft.saved, [("w", weight)])
        first, second = files.files(), files.files()
        assert not files.built_here and peft.calls == 2, case
        assert first == second and CONFIG in dict(first), case


def test_a_layout_of_trained_tensors_only_is_learned_from_one_peft_save():
    weight = torch.ones(2, 3)
    peft = ScriptedPeft({"w": weight})
    files = AdapterFiles(peft.save, lambda: peft.saved, [("w", weight)])
    files.files()
    weight.add_(1.0)
    built = files.files()
    assert files.built_here and peft.calls == 1
    with tempfile.TemporaryDirectory() as tmp:
        peft.save(Path(tmp))
        assert built == [(path.name, path.read_bytes()) for path in sorted(Path(tmp).iterdir())]
