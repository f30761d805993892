"""Token text for the logprob view: the base model's own tokenizer (``tokenizer.json``, read
with the ``tokenizers`` library, no torch), loaded once per base model; without one, the ids."""

from __future__ import annotations

import functools
import math
from pathlib import Path

from artery.shared.logs import get_logger

log = get_logger(__name__)


@functools.lru_cache(maxsize=8)
def _tokenizer(base_model: str):
    try:
        from tokenizers import Tokenizer

        from artery.shared.models import resolve_base_model

        path = Path(resolve_base_model(base_model)) / "tokenizer.json"
        return Tokenizer.from_file(str(path)) if path.is_file() else None
    except Exception as exc:  # no tokenizers library, a hub name not in the cache...
        log.info("no tokenizer for the logprob view", base_model=base_model, error=str(exc))
        return None


def shaded_tokens(sample: dict, base_model: str | None) -> list[dict]:
    """One entry per sampled token: its text, logprob, probability and the alternatives."""
    ids = sample.get("token_ids") or []
    logprobs = sample.get("logprobs") or []
    tops = sample.get("top_logprobs") or []
    tokenizer = _tokenizer(base_model) if base_model else None
    out = []
    for i, token_id in enumerate(ids):
        logprob = logprobs[i] if i < len(logprobs) else None
        if tokenizer is not None:
            text = tokenizer.decode([token_id], skip_special_tokens=False)
        else:
            text = next(
                (t["token"] for t in (tops[i] if i < len(tops) else []) if t.get("token_id") == token_id),
                f"⟨{token_id}⟩",
            )
        prob = math.exp(logprob) if isinstance(logprob, int | float) and math.isfinite(logprob) else None
        alternatives = ", ".join(
            f"{t['token']!r} {t['logprob']:.2f}" for t in (tops[i] if i < len(tops) else [])
        )
        out.append(
            {"id": token_id, "text": text, "logprob": logprob, "prob": prob, "alternatives": alternatives}
        )
    return out
