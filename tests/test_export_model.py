"""Models out and back in: ``artery export-model`` writes a published step as a PEFT adapter or
as merged weights that transformers loads by itself, each giving the inference service's greedy
tokens; and a PEFT adapter directory as ``base_model`` warm-starts a model (step 0 serves the
adapter, training continues from its weights)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import asyncpg
import msgspec
import pytest
import torch
from safetensors.torch import load_file

import artery as art
from artery.ops.export_model import PublishedStep, write_merged, write_peft
from artery.services.trainer.policy import LoraSettings, OptimSettings, Policy
from artery.shared.models import TINY, resolve_base_model, warm_start
from artery.testing.agents import half_alphabet_rollout
from artery.testing.tasks import half_alphabet_task_prompt
from tests.helpers import wait_for

PROMPTS = [half_alphabet_task_prompt(), [{"role": "user", "content": "count to three."}]]
MAX_TOKENS = 12
TAUGHT = [
    art.Trajectory(
        messages_and_choices=[
            {"role": "user", "content": "count to three."},
            {"role": "assistant", "content": a},
        ]
    )
    for a in ("one two three.", "one two three.", "one two three.")
]


@pytest.fixture
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT's and transformers' advice about tiny models
        yield


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation by Hugging Face ``generate`` (the reference the engine must match)."""
    model.eval()
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_new_tokens,
        )
    return out[0, len(prompt_ids) :].tolist()


def load_peft_dir(directory: Path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    config = json.loads((directory / "adapter_config.json").read_text())
    base = AutoModelForCausalLM.from_pretrained(resolve_base_model(config["base_model_name_or_path"]))
    return PeftModel.from_pretrained(base, str(directory))


# --------------------------------------------------------------------------- the layouts, in process


def test_merged_weights_equal_the_adapter_on_its_base_with_a_tied_lm_head(tmp_path, _quiet):
    """The tiny model ties lm_head to the embeddings and the adapter trains lm_head: merging into
    the shared matrix would move the embeddings too. The merged model's logits are the adapter's."""
    from transformers import AutoModelForCausalLM

    policy = Policy.create(TINY, LoraSettings(), OptimSettings(), seed=0)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a visibly trained adapter: every LoRA B non-zero
        for name, param in policy.model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    adapter = policy.adapter_dir(policy.save(tmp_path / "ckpt"))
    found = PublishedStep(
        project="p", model="m", step=3, object_name="p/m/000003", sha256="0" * 64, base_model=TINY
    )
    peft_dir = write_peft(adapter, found, tmp_path / "peft")
    merged_dir = write_merged(adapter, found, tmp_path / "merged")

    config = json.loads((peft_dir / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == TINY  # its identity, not the trainer's path
    assert (peft_dir / "adapter_model.safetensors").is_file() and (peft_dir / "tokenizer.json").is_file()
    assert "base_model: artery/tiny-random" in (peft_dir / "README.md").read_text()
    merged_config = json.loads((merged_dir / "config.json").read_text())
    assert merged_config["tie_word_embeddings"] is False
    assert not list(merged_dir.glob("*.bin"))

    ids = torch.tensor([[5, 17, 42, 99, 7, 3]])
    peft_model = load_peft_dir(peft_dir).eval()
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    base = AutoModelForCausalLM.from_pretrained(resolve_base_model(TINY)).eval()
    with torch.inference_mode():
        expected = peft_model(ids).logits
        got = merged(ids).logits
        untouched = base(ids).logits
    assert not torch.allclose(expected, untouched, atol=1e-3)  # the adapter does change the model
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)  # float32 merge: rounding only
    # The embeddings are the base's: only the output matrix took the adapter's lm_head delta.
    torch.testing.assert_close(
        merged.get_input_embeddings().weight, base.get_input_embeddings().weight, rtol=0, atol=0
    )


def test_a_peft_adapter_directory_is_a_warm_start(tmp_path, _quiet):
    policy = Policy.create(TINY, LoraSettings(rank=4, alpha=8, target_modules=("q_proj", "lm_head")))
    with torch.no_grad():
        for name, param in policy.model.named_parameters():
            if "lora_B" in name:
                param.fill_(0.01)
    adapter = policy.adapter_dir(policy.save(tmp_path / "ckpt"))
    found = warm_start(adapter)
    assert found is not None and found.base_path() == resolve_base_model(TINY)
    assert warm_start(resolve_base_model(TINY)) is None  # a model directory is not an adapter

    warm = Policy.create(adapter)  # the adapter's own shape, and its weights, trainable
    assert (warm.lora.rank, warm.lora.alpha, warm.lora.target_modules) == (4, 8.0, ("lm_head", "q_proj"))
    saved = load_file(adapter / "adapter_model.safetensors")
    state = {k: v for k, v in warm.model.state_dict().items() if "lora_" in k}
    assert len(saved) == len(state) > 0
    for key, value in saved.items():
        torch.testing.assert_close(state[key.replace(".weight", ".default.weight")], value, rtol=0, atol=0)
    assert all(p.requires_grad for _, p in warm.named_trainable)
    with pytest.raises(ValueError, match="is an adapter of shape"):
        Policy.create(adapter, LoraSettings(rank=8))

    # The trainer service takes the model's shape from the adapter, and refuses another one.
    from artery.schemas import LoraSpec, ModelRecord
    from artery.services.trainer.checkpoints import LoraChanged, lora_settings
    from artery.services.trainer.settings import TrainerSettings

    record = ModelRecord(project="p", name="m", base_model=str(adapter), trainable=True)
    assert lora_settings(TrainerSettings(), record) == warm.lora
    same = msgspec.structs.replace(record, lora=LoraSpec(rank=4))
    assert lora_settings(TrainerSettings(), same) == warm.lora
    with pytest.raises(LoraChanged, match="warm-starts from the adapter"):
        lora_settings(TrainerSettings(), msgspec.structs.replace(record, lora=LoraSpec(rank=16)))


# --------------------------------------------------------------------------- through every service


async def served_greedy(model: art.TrainableModel, name: str) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, greedy completion ids) of each prompt, as the inference service answers."""
    out = []
    for messages in PROMPTS:
        response = await model.openai_client().chat.completions.create(
            model=name, messages=messages, max_tokens=MAX_TOKENS, temperature=0
        )
        out.append((response.model_extra["prompt_token_ids"], response.choices[0].model_extra["token_ids"]))
    return out


def run_cli(backend: art.LocalBackend, *args: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "ARTERY_NATS_URL": backend.stack.nats_url,
        "ARTERY_DATABASE_URL": backend.stack.database_url,
    }
    run = subprocess.run(
        [sys.executable, "-m", "artery.ops.cli", *args], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr
    return run


async def train_steps(model: art.TrainableModel, steps: int) -> list[art.TrainResult]:
    results = []
    for _ in range(steps):
        groups = await art.gather_trajectory_groups(
            (
                art.TrajectoryGroup(half_alphabet_rollout(model, max_tokens=8) for _ in range(6))
                for _ in range(2)
            ),
            pbar_desc="rollouts",
        )
        results.append(await model.train(groups, config=art.TrainConfig(learning_rate=2e-2)))
    return results


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_exported_models_give_the_served_greedy_tokens_and_warm_start_a_model(tmp_path, _quiet):
    from transformers import AutoModelForCausalLM

    backend = art.LocalBackend(path=tmp_path / "artery", services=("collector", "trainer", "publisher"))
    model = art.TrainableModel(name="exported", project="models", base_model=TINY)
    try:
        await model.register(backend)
        base_tokens = await served_greedy(model, f"{model.name}@0")
        # A GRPO step, then SFT steps that teach an answer: the tiny random model's greedy
        # answers are one repeated token until something is learnt.
        await train_steps(model, 1)
        await model.train_sft(TAUGHT * 6, art.TrainSFTConfig(learning_rate=1e-2, batch_size=3))
        served = await served_greedy(model, f"{model.name}@2")
        assert served != base_tokens, "the steps must change the greedy answers"

        # export-model takes the newest *published* step; the replica serves step 2 from the
        # trainer's file before the publisher has recorded it: wait for the publisher's row.
        conn = await asyncpg.connect(backend.database_url)
        try:
            await wait_for(
                lambda: conn.fetchval("SELECT count(*) = 2 FROM checkpoints WHERE published_at IS NOT NULL"),
                timeout=60,
            )
        finally:
            await conn.close()
        peft_dir, merged_dir = tmp_path / "out" / "peft", tmp_path / "out" / "merged"
        run = await asyncio.to_thread(
            run_cli, backend, "export-model", "--project", "models", "--model", "exported",
            "--format", "peft", str(peft_dir),
        )  # fmt: skip
        assert "step 2" in run.stdout
        await asyncio.to_thread(
            run_cli, backend, "export-model", "--project", "models", "--model", "exported",
            "--step", "2", "--format", "merged", str(merged_dir),
        )  # fmt: skip
        peft_model = load_peft_dir(peft_dir)
        merged = AutoModelForCausalLM.from_pretrained(merged_dir)
        for prompt_ids, tokens in served:
            assert hf_greedy(peft_model, prompt_ids, MAX_TOKENS)[: len(tokens)] == tokens
            assert hf_greedy(merged, prompt_ids, MAX_TOKENS)[: len(tokens)] == tokens

        # Warm start: the exported adapter as another model's base_model.
        warm = art.TrainableModel(name="warm", project="models", base_model=str(peft_dir))
        await warm.register(backend)
        assert await served_greedy(warm, f"{warm.name}@0") == served  # step 0 is the adapter
        (result,) = await train_steps(warm, 1)
        # The trainer started from the adapter the replica sampled with: its probabilities of the
        # sampled tokens equal the sampler's (float noise only), where the bare base's would not.
        assert result.step == 1 and result.metrics["ratio_mean"] == pytest.approx(1.0, abs=2e-3)
        step_one = tmp_path / "out" / "warm1"
        await asyncio.to_thread(
            run_cli, backend, "export-model", "--project", "models", "--model", "warm",
            "--format", "peft", str(step_one),
        )  # fmt: skip
        assert json.loads((step_one / "adapter_config.json").read_text())["base_model_name_or_path"] == TINY
        before = load_file(peft_dir / "adapter_model.safetensors")
        after = load_file(step_one / "adapter_model.safetensors")
        assert before.keys() == after.keys()  # the adapter's own shape, trained on
        assert any(not torch.equal(after[k], before[k]) for k in before)
    finally:
        await backend.close()


def test_an_export_replaces_only_an_earlier_export_or_an_empty_directory(tmp_path):
    from artery.ops.export_model import _move_into_place, check_output

    check_output(tmp_path / "new")  # not there yet
    (tmp_path / "empty").mkdir()
    check_output(tmp_path / "empty")
    home = tmp_path / "home"
    home.mkdir()
    (home / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not an earlier export"):
        check_output(home)
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="not a directory"):
        check_output(tmp_path / "file")

    # An earlier export is replaced whole, and only once the new one is complete.
    earlier = tmp_path / "export"
    earlier.mkdir()
    (earlier / "README.md").write_text("---\nbase_model: x\ntags:\n- artery\n- grpo\n---\n")
    (earlier / "stale.safetensors").write_text("old")
    staging = tmp_path / ".export.new"
    staging.mkdir()
    (staging / "adapter_model.safetensors").write_text("new")
    assert _move_into_place(staging, earlier) == earlier
    assert sorted(p.name for p in earlier.iterdir()) == ["adapter_model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "export", "file", "home"]
    assert (home / "notes.txt").read_text() == "keep me"


async def test_a_warm_start_that_cannot_be_trained_is_refused_for_good(tmp_path):
    """A model registered on an adapter directory the trainer refuses (pickle weights only, bad
    JSON) fails its train request as not retriable, rather than being redelivered until poison."""
    from artery.schemas import ModelRecord
    from artery.services.trainer.checkpoints import ModelUnusable, PolicyCache
    from artery.services.trainer.settings import TrainerSettings

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "adapter_config.json").write_text(
        json.dumps(
            {"peft_type": "LORA", "base_model_name_or_path": TINY, "r": 2, "target_modules": ["q_proj"]}
        )
    )
    (pickled / "adapter_model.bin").write_bytes(b"not loaded")
    garbled = tmp_path / "garbled"
    garbled.mkdir()
    (garbled / "adapter_config.json").write_text("{not json")
    cache = PolicyCache(TrainerSettings(checkpoint_dir=str(tmp_path / "ckpt")))
    for adapter, reason in ((pickled, "pickle weights"), (garbled, "")):
        record = ModelRecord(project="p", name=adapter.name, base_model=str(adapter), trainable=True)
        with pytest.raises(ModelUnusable, match=f"p/{adapter.name}: .*{reason}"):
            await cache.get(record)
