"""The pure parts of the transformers engine: sampling, log-probabilities, seeds, stop strings."""

from __future__ import annotations

import math

import pytest
import torch

from artery.services.inference.engine import sampling
from artery.services.inference.engine.sampling import (
    completion_seed,
    processed_logprobs,
    sample_tokens,
    top_alternatives,
)
from artery.services.inference.engine.stops import first_stop, tail_tokens, trim_at_stop

PROBS = [0.5, 0.3, 0.2]


def _logprobs(probs=PROBS, rows=1):
    return torch.tensor([probs] * rows).log()


def _sample(uniform, temperature=1.0, top_p=1.0, probs=PROBS):
    lp = _logprobs(probs)
    return sample_tokens(
        lp, torch.tensor([temperature]), torch.tensor([top_p]), torch.tensor([uniform])
    ).item()


def test_logprobs_are_after_temperature():
    logits = torch.tensor([[1.0, 2.0, 4.0], [1.0, 2.0, 4.0], [1.0, 2.0, 4.0]])
    lp = processed_logprobs(logits, torch.tensor([1.0, 0.5, 0.0]))
    assert torch.allclose(lp[0], torch.log_softmax(logits[0], -1))
    assert torch.allclose(lp[1], torch.log_softmax(logits[1] / 0.5, -1))
    assert torch.allclose(lp[2], lp[0])  # greedy rows are scored at temperature 1
    assert lp.dtype == torch.float32


@pytest.mark.parametrize(
    ("uniform", "token"), [(0.0, 0), (0.49, 0), (0.51, 1), (0.79, 1), (0.81, 2), (0.999, 2)]
)
def test_inverse_cdf(uniform, token):
    assert _sample(uniform) == token


@pytest.mark.parametrize(("uniform", "token"), [(0.1, 0), (0.62, 0), (0.63, 1), (0.999, 1)])
def test_top_p_keeps_the_nucleus_and_renormalises(uniform, token):
    # top_p 0.6: tokens 0 and 1 (mass before token 1 is 0.5 < 0.6), renormalised over 0.8.
    assert _sample(uniform, top_p=0.6) == token


def test_top_p_always_keeps_the_most_likely_token():
    assert {_sample(u, top_p=0.01) for u in (0.0, 0.5, 0.999)} == {0}


def test_greedy_ignores_the_draw():
    assert {_sample(u, temperature=0.0, probs=[0.2, 0.5, 0.3]) for u in (0.0, 0.5, 0.99)} == {1}


def test_rows_use_their_own_settings():
    lp = _logprobs(rows=3)
    tokens = sample_tokens(
        lp, torch.tensor([0.0, 1.0, 1.0]), torch.tensor([1.0, 1.0, 0.4]), torch.tensor([0.9] * 3)
    )
    assert tokens.tolist() == [0, 2, 0]


def test_frequencies_match_the_distribution():
    n = 20_000
    gen = torch.Generator().manual_seed(0)
    tokens = sample_tokens(_logprobs(rows=n), torch.ones(n), torch.ones(n), torch.rand(n, generator=gen))
    freq = torch.bincount(tokens, minlength=3).float() / n
    assert torch.allclose(freq, torch.tensor(PROBS), atol=0.015)


def test_tokens_without_mass_are_never_drawn():
    probs = [0.5, 0.5, 0.0, 0.0]
    lp = torch.tensor([probs]).log()
    for u in (0.0, 0.25, 0.5, 0.75, 1.0 - 1e-9):
        assert sample_tokens(lp, torch.ones(1), torch.ones(1), torch.tensor([u])).item() in (0, 1)


def test_top_p_on_a_large_vocabulary_matches_a_full_sort(monkeypatch):
    """Peaked rows find their nucleus among the top-k candidates, flat rows fall back to a sort:
    both give what sorting everything gives."""
    gen = torch.Generator().manual_seed(0)
    peaked = torch.randn(4, 5000, generator=gen) * 6
    flat = torch.randn(4, 5000, generator=gen) * 0.01
    logprobs = torch.log_softmax(torch.cat([peaked, flat]), dim=-1)
    ones, top_p = torch.ones(8), torch.full((8,), 0.9)
    for _ in range(5):
        uniform = torch.rand(8, generator=gen)
        fast = sample_tokens(logprobs, ones, top_p, uniform)
        monkeypatch.setattr(sampling, "NUCLEUS_CANDIDATES", 5000)
        slow = sample_tokens(logprobs, ones, top_p, uniform)
        monkeypatch.undo()
        assert fast.tolist() == slow.tolist()


def test_top_alternatives_sorted():
    lp = _logprobs([0.2, 0.5, 0.3])
    [top] = top_alternatives(lp, 2)
    assert [t for t, _ in top] == [1, 2]
    assert math.isclose(top[0][1], math.log(0.5), rel_tol=1e-6)
    assert top_alternatives(lp, 0) == [[]]
    assert len(top_alternatives(lp, 10)[0]) == 3


def test_completion_seeds():
    seeds = {completion_seed(s, i) for s in (0, 1, 2, -1) for i in range(4)}
    assert len(seeds) == 16
    assert all(0 <= s < 2**63 for s in seeds)
    assert completion_seed(7, 1) == completion_seed(7, 1)
    torch.Generator().manual_seed(completion_seed(-5, 0))


def test_stop_strings():
    stops = ("END", "\n\n")
    assert first_stop("abc\n\nxEND", stops) == 3
    assert first_stop("abc", stops) is None
    assert first_stop("abc", ()) is None
    assert trim_at_stop("the answer END more", stops) == "the answer "
    assert trim_at_stop("nothing", stops) == "nothing"
    assert tail_tokens(stops) == 4 * 3 + 8
