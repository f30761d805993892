"""The tiny test model: it loads like any Hugging Face model, its chat template renders tools and
assistant masks, and it builds the same way every time."""

from __future__ import annotations

import json
import threading

import pytest
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from artery.shared import tiny_model
from artery.shared.tiny_model import build_tiny_model, tiny_model_path

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            },
        },
    }
]

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 3?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "5"},
    {"role": "assistant", "content": "It is 5."},
]


@pytest.fixture(scope="module")
def path():
    return tiny_model_path()


@pytest.fixture(scope="module")
def tokenizer(path):
    return AutoTokenizer.from_pretrained(path)


def test_loads_as_a_tied_qwen2(path, tokenizer):
    model = AutoModelForCausalLM.from_pretrained(path)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert 100_000 <= sum(p.numel() for p in model.parameters()) <= 200_000
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.config.vocab_size == len(tokenizer)
    assert (path / "model.safetensors").is_file()
    assert not list(path.glob("*.bin"))


def test_special_tokens(tokenizer):
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    for token in ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>", "</tool_call>"):
        assert tokenizer.encode(token) == [tokenizer.convert_tokens_to_ids(token)]
    ids = tokenizer.encode('<tool_call>\n{"name": "add"}\n</tool_call><|im_end|>')
    # A tool call is text for the API layer to parse: it survives skipping special tokens.
    assert tokenizer.decode(ids, skip_special_tokens=True) == '<tool_call>\n{"name": "add"}\n</tool_call>'
    text = 'Hello world, what is 12 + 34? {"a": [1, 2]} é ü 日本'
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_template_without_tools(tokenizer):
    messages = [m for m in CONVERSATION if m["role"] in ("system", "user")]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_system = tokenizer.apply_chat_template(messages[1:], tokenize=False)
    assert no_system == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"


def test_template_with_tools(tokenizer):
    text = tokenizer.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False)
    system, rest = text.split("<|im_end|>\n", 1)
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    tools_json = system.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0]
    assert json.loads(tools_json) == TOOLS[0]
    assert rest == (
        "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nIt is 5.<|im_end|>\n"
    )
    # Arguments given as an object render the same as the JSON string OpenAI sends.
    as_dict = [dict(m) for m in CONVERSATION]
    as_dict[2] = {**as_dict[2], "tool_calls": [{"function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]}
    assert tokenizer.apply_chat_template(as_dict, tools=TOOLS, tokenize=False) == text


def test_assistant_mask_covers_exactly_the_assistant_turns(tokenizer):
    out = tokenizer.apply_chat_template(
        CONVERSATION, tools=TOOLS, return_assistant_tokens_mask=True, return_dict=True
    )
    ids, mask = out["input_ids"], out["assistant_masks"]
    assert len(ids) == len(mask) and any(mask)
    spans, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append(tokenizer.decode(ids[start:i]))
            start = None
    assert spans == [
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>',
        "It is 5.<|im_end|>",
    ]
    # What the mask leaves out is exactly the rest of the conversation.
    unmasked = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if not m])
    assert "It is 5." not in unmasked and "<tool_call>\n{" not in unmasked.split("</tools>")[1]


def test_build_is_deterministic(tmp_path):
    a = build_tiny_model(tmp_path / "a", seed=3)
    b = build_tiny_model(tmp_path / "b", seed=3)
    c = build_tiny_model(tmp_path / "c", seed=4)
    wa, wb, wc = (load_file(p / "model.safetensors") for p in (a, b, c))
    assert wa.keys() == wb.keys()
    assert all(wa[k].equal(wb[k]) for k in wa)
    assert not wa["model.embed_tokens.weight"].equal(wc["model.embed_tokens.weight"])
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()  # seed is weights only


def test_cached_path_is_built_once_even_in_parallel(tmp_path, monkeypatch):
    monkeypatch.setenv("ARTERY_CACHE_DIR", str(tmp_path))
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(tiny_model_path())) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results[0] == results[1] == tmp_path / "models" / tiny_model.TINY_MODEL_VERSION
    built = (results[0] / "model.safetensors").stat().st_mtime_ns
    assert tiny_model_path() == results[0]
    assert (results[0] / "model.safetensors").stat().st_mtime_ns == built
    assert [p.name for p in (tmp_path / "models").iterdir()] == [tiny_model.TINY_MODEL_VERSION]
    AutoModelForCausalLM.from_pretrained(results[0])
