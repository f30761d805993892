"""Continuous batching in the transformers engine: requests join a running batch between steps.

On the tiny random model. A joined row must decode exactly what it decodes alone, whichever rows
it joins; requests for another adapter, or that need more rows than are free, wait for the batch
to drain and are not overtaken by requests that keep arriving.
"""

from __future__ import annotations

import asyncio
import threading
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM

from artery.services.inference.engine.base import EngineError, SamplingParams
from artery.services.inference.engine.decode import DecodeContext, DecodeStats, Row, decode_batch
from artery.services.inference.engine.transformers_engine import TransformersEngine
from artery.shared.kv_cache_name import CACHE
from artery.shared.tiny_model import tiny_model_path
from tests.test_engine_transformers import _prompt, _request, save_random_adapter

#: The running request in these tests: greedy, it runs its whole budget (asserted where it matters).
LONG_TOKENS = 64


@pytest.fixture(scope="module")
def model_path():
    return tiny_model_path()


@pytest.fixture(scope="module")
def adapter_dir(model_path, tmp_path_factory):
    return save_random_adapter(model_path, tmp_path_factory.mktemp("adapter"))


@pytest.fixture
async def engine(model_path):
    engine = TransformersEngine(model_path)
    await engine.start()
    yield engine
    await engine.close()


@pytest.fixture
async def two_row_engine(model_path):
    engine = TransformersEngine(model_path, max_batch_size=2)
    await engine.start()
    yield engine
    await engine.close()


def _long_request(engine, **params):
    params = {"temperature": 0, "max_tokens": LONG_TOKENS, **params}
    return _request(_prompt(engine, "Tell me a long story."), **params)


async def _collect(steps, name: str, finished: list[str]):
    """Every step of a stream; ``name`` goes into ``finished`` when the stream ends."""
    out = [step async for step in steps]
    finished.append(name)
    return out


async def test_a_request_joins_the_running_batch(engine):
    finished: list[str] = []
    batches, passes = engine.stats.batches, engine.stats.forward_passes
    running = engine.stream(_long_request(engine))
    first = await anext(running)
    short = asyncio.create_task(
        _collect(engine.stream(_request(_prompt(engine), temperature=0, max_tokens=8)), "short", finished)
    )
    rest = await _collect(running, "running", finished)
    assert len(await short) == 8
    assert [first, *rest][-1].finish_reason == "length" and len(rest) == LONG_TOKENS - 1
    assert finished == ["short", "running"]  # it did not wait for the running request to end
    assert engine.stats.batches - batches == 1
    # Alone they take 64 + 8 forward passes; together, the running row's 64 and one prefill.
    assert engine.stats.forward_passes - passes == LONG_TOKENS + 1


@pytest.mark.parametrize(
    "sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 5}], ids=["greedy", "seeded"]
)
async def test_joining_a_batch_changes_no_token(engine, sampling):
    prompts = {
        "running": _prompt(engine, "Tell me a long story."),
        "shorter": _prompt(engine, "hi"),  # shorter than the running row
        "longer": _prompt(engine, "a much longer prompt " * 16),  # longer than it, at any step
    }
    assert len(prompts["shorter"]) < len(prompts["running"])
    assert len(prompts["running"]) + LONG_TOKENS < len(prompts["longer"])
    requests = {
        "running": _request(prompts["running"], max_tokens=LONG_TOKENS, logprobs=True, **sampling),
        "shorter": _request(prompts["shorter"], max_tokens=24, n=2, logprobs=True, **sampling),
        "longer": _request(prompts["longer"], max_tokens=24, logprobs=True, **sampling),
    }
    alone = {name: await engine.generate(r) for name, r in requests.items()}

    batches = engine.stats.batches
    streams = {name: engine.stream(r) for name, r in requests.items()}
    steps = {"running": [await anext(streams["running"])]}
    steps["shorter"] = [await anext(streams["shorter"])]  # joined a batch wider than itself
    steps["longer"] = [await anext(streams["longer"])]  # joined a batch narrower than itself
    for name, rest in zip(
        steps, await asyncio.gather(*(_collect(s, name, []) for name, s in streams.items())), strict=True
    ):
        steps[name] += rest
    assert engine.stats.batches - batches == 1  # all three decoded in one batch

    for name, completions in alone.items():
        for c in completions:
            mine = [s for s in steps[name] if s.index == c.index]
            assert [s.token_id for s in mine] == c.token_ids, name
            assert torch.allclose(
                torch.tensor([s.logprob for s in mine]), torch.tensor(c.logprobs), atol=1e-5
            )


async def test_another_adapter_waits_for_the_batch_and_is_not_starved(engine, adapter_dir):
    await engine.load_adapter("tuned@1", adapter_dir)
    prompt = _prompt(engine)
    base = _request(prompt, temperature=0, max_tokens=8)
    tuned = _request(prompt, adapter="tuned@1", temperature=0, max_tokens=8)
    [base_alone] = await engine.generate(base)
    [tuned_alone] = await engine.generate(tuned)
    assert base_alone.token_ids != tuned_alone.token_ids

    finished: list[str] = []
    batches = engine.stats.batches
    running = engine.stream(_long_request(engine))
    await anext(running)
    waiting = asyncio.create_task(_collect(engine.stream(tuned), "tuned", finished))
    followers = []  # base-model requests that keep arriving while the base batch runs
    async for _ in running:
        if len(followers) < 4:
            stream = engine.stream(base)
            followers.append(asyncio.create_task(_collect(stream, f"follower {len(followers)}", finished)))
    finished.append("running")
    tuned_steps, *follower_steps = await asyncio.gather(waiting, *followers)

    # The followers did not join the base batch once the tuned request waited, nor the tuned batch.
    assert finished[:2] == ["running", "tuned"]
    assert engine.stats.batches - batches == 3
    assert [s.token_id for s in tuned_steps] == tuned_alone.token_ids
    assert all([s.token_id for s in steps] == base_alone.token_ids for steps in follower_steps)


async def test_a_request_that_does_not_fit_is_not_overtaken(model_path):
    engine = TransformersEngine(model_path, max_batch_size=4)
    await engine.start()
    try:
        finished: list[str] = []
        batches = engine.stats.batches
        running = engine.stream(_long_request(engine, n=2))
        await anext(running)
        prompt = _prompt(engine)
        wide = asyncio.create_task(  # three rows, two free: it waits for the batch to drain
            _collect(engine.stream(_request(prompt, temperature=1.0, n=3, max_tokens=4)), "wide", finished)
        )
        await asyncio.sleep(0)
        narrow = asyncio.create_task(  # one row would fit, but the wide request came first
            _collect(engine.stream(_request(prompt, temperature=1.0, max_tokens=4)), "narrow", finished)
        )
        await _collect(running, "running", finished)
        await asyncio.gather(wide, narrow)
        assert finished[0] == "running"
        assert engine.stats.batches - batches == 2
    finally:
        await engine.close()


async def test_cancelling_a_joined_request_frees_its_row(two_row_engine):
    engine = two_row_engine
    batches = engine.stats.batches
    running = engine.stream(_long_request(engine))
    await anext(running)
    joined = engine.stream(_request(_prompt(engine, "hi"), temperature=0, max_tokens=2000))
    await anext(joined)  # it holds the second row
    await joined.aclose()
    # Only a freed row lets this one in before the running request ends.
    [late] = await engine.generate(_request(_prompt(engine), temperature=0, max_tokens=4))
    assert len(late.token_ids) == 4
    assert engine.stats.batches - batches == 1
    assert len([s async for s in running]) == LONG_TOKENS - 1
    assert engine.stats.tokens < 3 * LONG_TOKENS


async def test_adapter_changes_wait_for_the_batch_to_drain(engine, adapter_dir):
    finished: list[str] = []
    running = engine.stream(_long_request(engine))
    await anext(running)
    loading = asyncio.create_task(engine.load_adapter("tuned@1", adapter_dir))
    loading.add_done_callback(lambda _: finished.append("loaded"))
    await asyncio.sleep(0)  # the load waits for the model: the batch stops admitting rows
    late = asyncio.create_task(
        _collect(engine.stream(_request(_prompt(engine), temperature=0, max_tokens=4)), "late", finished)
    )
    await _collect(running, "running", finished)
    await asyncio.gather(loading, late)
    assert finished == ["running", "loaded", "late"]
    assert engine.adapters() == ["tuned@1"]


async def test_close_ends_joined_running_and_waiting_requests(model_path):
    engine = TransformersEngine(model_path, max_batch_size=2)
    await engine.start()
    running = engine.stream(_long_request(engine, max_tokens=2000))
    await anext(running)
    joined = engine.stream(_request(_prompt(engine, "hi"), temperature=0, max_tokens=2000))
    await anext(joined)
    waiting = asyncio.create_task(engine.generate(_request(_prompt(engine), temperature=0, max_tokens=5)))
    await asyncio.sleep(0)  # submitted; no row is free
    await engine.close()
    for stream in (running, joined):
        with pytest.raises(EngineError, match="clos"):
            async for _ in stream:
                pass
    with pytest.raises(EngineError, match="clos"):
        await waiting


def test_a_finished_row_takes_its_columns_with_it(model_path):
    """Columns that only finished rows attended to are cut from the cache and the mask: in a batch
    that rows keep joining, they would otherwise pile up and cost attention on every step."""
    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    widths: list[int] = []

    def spy(**inputs):
        widths.append(inputs["attention_mask"].shape[-1])
        return model(**inputs)

    spy.config = model.config
    params = SamplingParams(max_tokens=6, temperature=0)
    long, short = [7] * 40, [9] * 5

    def row(prompt, tokens):
        return Row(None, 0, prompt, params, torch.Generator(), tokens)

    ctx = DecodeContext(
        spy, None, torch.device("cpu"), frozenset(), 0, lambda steps: None, threading.Event(), DecodeStats()
    )
    with torch.inference_mode():
        decode_batch([row(long, 2), row(short, 6)], ctx)
    # The prefill and one step at the long row's width; then the short row's own width, growing.
    assert widths == [40, 41, 7, 8, 9, 10]


def test_decode_passes_the_cache_under_the_name_transformers_keeps(model_path):
    """transformers 5.x renamed ``past_key_values`` to ``cache``: the old name still works but
    warns at every forward pass and goes in 5.40. The prefill and each step pass the new name."""
    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    passed: list[set[str]] = []

    def spy(**inputs):
        passed.append(set(inputs))
        return model(**inputs)

    spy.config = model.config
    ctx = DecodeContext(
        spy, None, torch.device("cpu"), frozenset(), 0, lambda steps: None, threading.Event(), DecodeStats()
    )
    row = Row(None, 0, [7] * 5, SamplingParams(max_tokens=3, temperature=0), torch.Generator(), 3)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*past_key_values")  # the deprecation, were it passed
        with torch.inference_mode():
            decode_batch([row], ctx)
    assert len(passed) == 3  # the prefill and two steps
    assert all(CACHE in names for names in passed)
    if CACHE != "past_key_values":
        assert not any("past_key_values" in names for names in passed)
