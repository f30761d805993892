"""Toy RL tasks, for tests, benchmarks and end-to-end runs.

The tiny random model (``tiny_model.py``) answers nearly uniform tokens from its ~1k vocabulary, so
a reward must already be met part of the time for GRPO to get a signal, and the tokens that score
well must not be mostly traps (a token that scores 0.67 on which the policy collapses before it
finds one that scores 1). Measured with ``Policy`` (LoRA r8 including ``lm_head``, 2 groups x 8
samples of 8 tokens at temperature 1, lr 1e-2), mean reward at step 0 and whether it passed 0.8
within 60 steps:

- **half_alphabet** (the one to use on the tiny model): the share of characters that are lowercase
  a-m. Starts at ~0.40; passed 0.8 by step 20-32 for 10 of 10 seeds (cispo and grpo at 1e-2;
  29-43 at 5e-3). 78 of the ~1k tokens score >= 0.8.
- vowels: starts at ~0.30 but only 14 tokens score >= 0.8 and 177 score 0.5-0.8; 2 of 5 seeds
  collapsed onto "ool" (0.67) for good.
- a-h only: starts at ~0.28; 7 of 8 seeds passed, one collapsed at 0.75.
- **digits**: natural for a real instruct model asked for a number, but on the tiny model it starts
  at ~0.003 (10 single-digit tokens in 1,000): most groups score 0 everywhere, no signal.

For SmolLM2-135M-Instruct (``make demo``) the task is **lowercase**: "Write one short sentence about
a <subject>, in lowercase letters only.", after one worked example turn. The reward
(``lowercase_reward``) is 0 for anything empty, repetitive, garbled or not about the subject, so a
collapse to short or degenerate answers earns nothing; a valid answer scores 0.2, +0.5 without
uppercase letters, +0.3 as one sentence of 3-15 words. Measured (LoRA r8 with ``lm_head``, 2 groups
x 8 samples of at most 20 tokens at temperature 1, lr 3e-4, cispo): held-out subjects, 2 seeded
samples each, 0.35-0.37 before and 0.97-0.99 after 20 steps; greedy 0.74 -> 0.94-0.98. Without the
worked example the model almost never writes lowercase (none in 48 probe samples, nor in 8
training steps: no signal); a length reward collapses to empty answers (ENVIRONMENT.md).

An empty answer scores 0 in every task here, so stopping at once is no way out; in the character
tasks a short answer that scores 1 is, and that is fine for a toy. The task functions are pure (no
model, no I/O). ``sample_trajectories`` stands in for the inference service in tests and
benchmarks: it needs torch and a model, and imports them lazily.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from artery.schemas import Trajectory

HALF_ALPHABET = frozenset("abcdefghijklm")


def half_alphabet_task_prompt() -> list[dict[str, str]]:
    """The fixed chat prompt of the half-alphabet task, as OpenAI chat messages."""
    return [{"role": "user", "content": "Reply using only the letters a to m, for example: bad cafe hide."}]


def half_alphabet_reward(text: str) -> float:
    """Share of the characters that are lowercase letters a-m; 0.0 for empty text."""
    return sum(c in HALF_ALPHABET for c in text) / len(text) if text else 0.0


def digits_task_prompt() -> list[dict[str, str]]:
    """The fixed chat prompt of the digits task, as OpenAI chat messages."""
    return [{"role": "user", "content": "Write a long number, digits only."}]


def digits_reward(text: str) -> float:
    """Share of the characters that are decimal digits; 0.0 for empty text."""
    return sum(c.isdigit() for c in text) / len(text) if text else 0.0


# --------------------------------------------------------------------------- lowercase sentence

#: Subjects of the lowercase-sentence task: the ones a run trains on, and held-out ones it is
#: evaluated on (never trained on).
SUBJECTS_TRAIN = (
    "cat", "dog", "horse", "bird", "owl", "lion", "tiger", "whale", "wolf", "rabbit",
    "tree", "flower", "rose", "forest", "garden", "river", "lake", "mountain", "desert", "island",
    "moon", "star", "cloud", "storm", "snow", "rain", "beach", "volcano", "bridge", "castle",
    "bread", "cheese", "apple", "coffee", "soup", "cake", "train", "ship", "bicycle", "car",
    "book", "clock", "candle", "chair", "window", "kitchen", "library", "market", "school", "village",
)  # fmt: skip
SUBJECTS_HELD_OUT = (
    "fox", "bee", "frog", "oak", "pond", "valley", "sun", "wind",
    "pizza", "lemon", "boat", "plane", "lamp", "piano", "museum", "farm",
)  # fmt: skip

_WORD = re.compile(r"[A-Za-z]+(?:'[A-Za-z]+)?")
#: What an answer may consist of: ASCII letters, digits, spaces and everyday punctuation.
_PLAIN = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 \n,.;:!?'\"-()")


#: The worked example that opens the lowercase-sentence prompt (its subject is in neither list).
LOWERCASE_EXAMPLE = ("kite", "a red kite dances high above the windy hill.")


def lowercase_task_prompt(subject: str, *, example: bool = True) -> list[dict[str, str]]:
    """The chat prompt of the lowercase-sentence task for ``subject`` (a noun, lowercase), as OpenAI
    chat messages: by default one worked example turn, then the question."""

    def ask(noun: str) -> dict[str, str]:
        return {
            "role": "user",
            "content": f"Write one short sentence about a {noun}, in lowercase letters only.",
        }

    shot = (
        [ask(LOWERCASE_EXAMPLE[0]), {"role": "assistant", "content": LOWERCASE_EXAMPLE[1]}] if example else []
    )
    return [*shot, ask(subject)]


def lowercase_reward_parts(text: str, subject: str) -> dict[str, float]:
    """The checks behind :func:`lowercase_reward`, each 0.0 or 1.0.

    - ``valid``: a real answer: at least 3 words, mostly distinct (at least 60% of them different
      words), at least 90% plain characters (letters, digits, spaces, everyday punctuation), and it
      names ``subject`` (or its plural). Empty, repetitive, off-topic or garbled text fails.
    - ``lowercase``: not a single uppercase letter.
    - ``one_sentence``: 3-15 words, ending with ``.`` or ``!`` and no other sentence end before it.
    """
    stripped = text.strip()
    words = [w.lower() for w in _WORD.findall(stripped)]
    plain = sum(c in _PLAIN for c in stripped) / len(stripped) if stripped else 0.0
    on_topic = re.search(rf"\b{re.escape(subject.lower())}(?:s|es)?\b", stripped.lower()) is not None
    repetitive = len(set(words)) < 0.6 * len(words)
    valid = len(words) >= 3 and not repetitive and plain >= 0.9 and on_topic
    lowercase = bool(stripped) and not any(c.isupper() for c in stripped)
    one_sentence = (
        3 <= len(words) <= 15 and stripped[-1:] in (".", "!") and not re.search(r"[.!?](\s|$)", stripped[:-1])
    )
    return {"valid": float(valid), "lowercase": float(lowercase), "one_sentence": float(one_sentence)}


def lowercase_reward(text: str, subject: str) -> float:
    """Reward of the lowercase-sentence task, in [0, 1]: 0 unless the answer is ``valid`` (see
    :func:`lowercase_reward_parts`), then 0.2, plus 0.5 when it has no uppercase letter, plus 0.3
    when it is one short sentence. Empty or degenerate answers score 0; a good one scores 1."""
    parts = lowercase_reward_parts(text, subject)
    if not parts["valid"]:
        return 0.0
    return 0.2 + 0.5 * parts["lowercase"] + 0.3 * parts["one_sentence"]


def sample_trajectories(
    model: Any,
    tokenizer: Any,
    messages: Sequence[dict[str, str]],
    reward: Callable[[str], float],
    *,
    n: int,
    max_new_tokens: int,
    temperature: float = 1.0,
) -> list[Trajectory]:
    """``n`` completions of ``messages`` sampled with ``model.generate`` (full softmax at
    ``temperature``: no top-k, no top-p), as wire trajectories the way the inference service
    records them: the exact sampled token ids (the stop token included when one was sampled), their
    logprobs at ``temperature``, and the reward of the decoded text. Draws from torch's global RNG."""
    import torch

    from artery.schemas import Message, Sample, Trajectory

    prompt = tokenizer.apply_chat_template(
        list(messages), add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    device = next(model.parameters()).device
    prompt = {k: v.to(device) for k, v in prompt.items()}
    stops = set(_eos_ids(model, tokenizer))
    with torch.no_grad():
        out = model.generate(
            **prompt,
            do_sample=True,
            temperature=temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_new_tokens,
            num_return_sequences=n,
            output_logits=True,
            return_dict_in_generate=True,
        )
    generated = out.sequences[:, prompt["input_ids"].shape[1] :]  # [n, L]
    logits = torch.stack(out.logits, dim=1).float() / temperature  # [n, L, V] raw logits
    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, generated.unsqueeze(-1)).squeeze(-1)  # [n, L]
    trajectories = []
    for row in range(n):
        ids = generated[row].tolist()
        end = next((i + 1 for i, t in enumerate(ids) if t in stops), len(ids))
        ids, lps = ids[:end], logprobs[row, :end].tolist()
        stopped = bool(ids) and ids[-1] in stops
        text = tokenizer.decode(ids, skip_special_tokens=True)
        sample = Sample(token_ids=ids, logprobs=lps, finish_reason="stop" if stopped else "length")
        trajectories.append(
            Trajectory(
                messages=[
                    *(Message(role=m["role"], content=m["content"]) for m in messages),  # type: ignore[arg-type]
                    Message(role="assistant", content=text, sample=sample),
                ],
                reward=float(reward(text)),
            )
        )
    return trajectories


def half_alphabet_groups(
    model: Any, tokenizer: Any, *, groups: int = 2, rollouts: int = 8, max_new_tokens: int = 8
) -> list[list[Trajectory]]:
    """A GRPO step's groups of the half-alphabet task sampled from ``model`` (the learning tests'
    shape: 2 groups of 8 rollouts, at most 8 tokens each)."""
    prompt = half_alphabet_task_prompt()
    return [
        sample_trajectories(
            model, tokenizer, prompt, half_alphabet_reward, n=rollouts, max_new_tokens=max_new_tokens
        )
        for _ in range(groups)
    ]


def _eos_ids(model: Any, tokenizer: Any) -> list[int]:
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    return [eos] if isinstance(eos, int) else list(eos)
