"""A tiny random Qwen2 chat model with a locally trained tokenizer, for tests and CPU smoke runs.

Nothing is downloaded: the byte-level BPE tokenizer is trained on a small corpus built in this
module, the weights are random (seeded), and the chat template is Qwen2.5's ChatML with Hermes
style tools and ``{% generation %}`` markers (so assistant-only training masks work). The model
answers nonsense, but every code path that a real Qwen2 takes (chat template, tool calls, LoRA,
KV cache, logprobs) runs on it in milliseconds.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path

#: Bump when anything below changes what gets built, so cached copies are rebuilt.
TINY_MODEL_VERSION = "tiny-qwen2-v1"

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
#: Added but not special: a tool call must survive ``decode(skip_special_tokens=True)``.
TOOL_TOKENS = ("<tool_call>", "</tool_call>")

# Qwen2.5's template, with two deliberate differences: no default system prompt (shorter prompts),
# and an assistant turn always starts with "<|im_start|>assistant\n" (as the generation prompt does),
# so that what the model is trained to produce is exactly what it produces when sampled.
CHAT_TEMPLATE = """\
{%- macro render_content(content) -%}
{%- if content is string -%}{{- content -}}
{%- elif content is iterable and content is not mapping -%}
{%- for part in content -%}{%- if part.type == 'text' -%}{{- part.text -}}{%- endif -%}{%- endfor -%}
{%- elif content is not none -%}{{- content -}}
{%- endif -%}
{%- endmacro -%}
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- render_content(messages[0].content) + '\\n\\n' }}
    {%- endif %}
    {{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '
        'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n'
        '{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + render_content(messages[0].content) + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant\\n' }}
        {%- generation %}
        {{- render_content(message.content) }}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
                {%- if (loop.first and message.content) or not loop.first %}{{- '\\n' }}{%- endif %}
                {{- '<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}
                {%- if tool_call.arguments is string %}{{- tool_call.arguments }}
                {%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>' }}
        {%- endgeneration %}
        {{- '\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + render_content(message.content) + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + render_content(message.content) + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

_WORDS = """
the a an and or but if then else when while for to of in on at by with from as is are was were be
been being have has had do does did can could will would should may might must not no yes all any
some each every many much more most few less least one two three four five six seven eight nine ten
zero hundred thousand first second last next number numbers add plus minus times divided equals sum
difference product answer question result total value count list item items name names word words
user assistant system tool tools function call calls arguments response content role message text
hello hi thanks please sorry okay sure help what which who whom whose why how where there here this
that these those it its they them their we us our you your he she him her his i me my mine
weather city today tomorrow temperature search find get set make take give tell say ask know think
time day week month year morning evening night hour minute apple banana orange book table chair
water coffee tea car train plane road river mountain sea sky sun moon star tree flower house school
good bad big small long short high low new old right left true false null none error ok done
correct wrong step steps solve problem math compute calculate check look read write open close
""".split()

_NAMES = ("add", "subtract", "multiply", "get_weather", "search", "lookup", "calculator", "echo")


def _corpus() -> list[str]:
    """The training text: fixed (its own seed), so the tokenizer never depends on the weight seed."""
    rng = random.Random(1234)
    lines: list[str] = []
    lines += [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 14))) for _ in range(400)]
    lines += [w.capitalize() + "." for w in _WORDS]
    lines += [" ".join(str(rng.randint(0, 10 ** rng.randint(1, 4))) for _ in range(6)) for _ in range(100)]
    for _ in range(300):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        op = rng.choice("+-*")
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        lines.append(f"What is {a} {op} {b}? {a} {op} {b} = {value}. <answer>{value}</answer>")
    for _ in range(150):
        name, a, b = rng.choice(_NAMES), rng.randint(0, 99), rng.randint(0, 99)
        lines.append(f'<tool_call>\n{{"name": "{name}", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>')
        lines.append(f'<tool_response>\n{{"result": {a + b}, "ok": true, "error": null}}\n</tool_response>')
        lines.append(
            f'{{"type": "function", "function": {{"name": "{name}", "description": "Add two numbers", '
            f'"parameters": {{"type": "object", "properties": {{"a": {{"type": "integer"}}}}, '
            f'"required": ["a", "b"]}}}}}}'
        )
    for _ in range(150):
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(2, 8)))
        lines.append(f"<|im_start|>user\n{words}?<|im_end|>\n<|im_start|>assistant\n{words}.<|im_end|>\n")
    lines.append("# Tools\n\nYou may call one or more functions to assist with the user query.\n")
    return lines


def _build_tokenizer(vocab_size: int):
    """Train byte-level BPE with exactly Qwen2's normalizer and pre-tokenizer, then wrap it in
    ``Qwen2Tokenizer``: transformers rebuilds that pipeline when it loads a qwen2 tokenizer, so
    training with anything else would tokenize differently after a save and load."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    raw = Tokenizer(models.BPE())
    raw.normalizer = normalizers.NFC()
    raw.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS) - len(TOOL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    raw.train_from_iterator(_corpus(), trainer=trainer)
    bpe = json.loads(raw.to_str())["model"]
    # transformers annotates merges as strings and unk_token as a string; the tokenizers BPE it
    # builds takes pairs, and None means no unknown token (byte-level BPE needs none).
    tokenizer = Qwen2Tokenizer(
        vocab=bpe["vocab"],
        merges=[tuple(m) for m in bpe["merges"]],  # type: ignore[misc]
        unk_token=None,  # type: ignore[arg-type]
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=2048,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tokenizer.add_tokens(list(TOOL_TOKENS), special_tokens=False)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


#: The default tiny model's width and attention heads: its shape is known before it is built
#: (``artery.ops.stack_engine`` picks its engine from the head size).
HIDDEN_SIZE, NUM_HEADS = 64, 4
HEAD_DIM = HIDDEN_SIZE // NUM_HEADS


def build_tiny_model(
    dest: Path,
    *,
    seed: int = 0,
    hidden_size: int = HIDDEN_SIZE,
    num_layers: int = 2,
    num_heads: int = NUM_HEADS,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    vocab_size: int = 1000,
    max_position_embeddings: int = 2048,
    initializer_range: float = 0.02,
) -> Path:
    """Write a tiny random Qwen2ForCausalLM and its tokenizer to ``dest``; same seed, same files."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    dest = Path(dest)
    tokenizer = _build_tokenizer(vocab_size)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range,
        tie_word_embeddings=True,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):  # construction draws from the global RNG: leave it as it was
        model = Qwen2ForCausalLM(config).eval()
    _init_weights(model, seed, initializer_range)
    model.generation_config = GenerationConfig(
        eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
        pad_token_id=ids["<|endoftext|>"],
        bos_token_id=ids["<|endoftext|>"],
    )
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dest, safe_serialization=True)
    tokenizer.save_pretrained(dest)
    return dest


def _init_weights(model, seed: int, std: float) -> None:
    """Qwen2's initialisation, drawn from a private generator: the global RNG is shared between
    threads, so two builds running at once would otherwise interleave their draws."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * std)


def cache_dir() -> Path:
    return Path(os.environ.get("ARTERY_CACHE_DIR") or Path.home() / ".cache" / "artery")


def tiny_model_path() -> Path:
    """The default tiny model, built once into the cache and shared by every process after that.

    Each builder writes into its own temporary directory and renames it into place: a rename is
    atomic, so a reader sees either no model or a complete one; a process that loses the race
    throws its copy away.
    """
    final = cache_dir() / "models" / TINY_MODEL_VERSION
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{TINY_MODEL_VERSION}-", dir=final.parent))
    try:
        build_tiny_model(tmp)
        try:
            tmp.rename(final)
        except OSError:
            if not (final / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
