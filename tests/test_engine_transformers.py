"""The transformers engine on the tiny random model: sampling, logprobs, batching, streaming, LoRA."""

from __future__ import annotations

import asyncio
import threading
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM

from artery.services.inference.engine.base import (
    Engine,
    EngineError,
    GenerationRequest,
    PreloadsAdapters,
    SamplingParams,
    UnknownAdapter,
)
from artery.services.inference.engine.transformers_engine import TransformersEngine
from artery.shared.tiny_model import tiny_model_path


@pytest.fixture(scope="module")
def model_path():
    return tiny_model_path()


@pytest.fixture(scope="module")
def reference(model_path):
    return AutoModelForCausalLM.from_pretrained(model_path).eval()


@pytest.fixture
async def engine(model_path):
    engine = TransformersEngine(model_path)
    await engine.start()
    yield engine
    await engine.close()


@pytest.fixture(scope="module")
def adapter_dir(model_path, tmp_path_factory):
    return save_random_adapter(model_path, tmp_path_factory.mktemp("adapter"))


def save_random_adapter(model_path, dest, *, seed: int = 0, rank: int = 4):
    """A LoRA that includes lm_head (on this tiny tied model, attention alone barely moves logits),
    its B random (a fresh one's is zero) from ``seed``."""
    from peft import LoraConfig, get_peft_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(
            AutoModelForCausalLM.from_pretrained(model_path),
            LoraConfig(r=rank, lora_alpha=8, target_modules=["q_proj", "v_proj", "lm_head"]),
        )
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=generator))
        model.save_pretrained(dest, safe_serialization=True, save_embedding_layers=False)
    return dest


def _prompt(engine, text="What is 2 + 3?"):
    messages = [{"role": "user", "content": text}]
    return engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)


def _request(prompt, adapter=None, **params):
    return GenerationRequest(list(prompt), SamplingParams(**{"max_tokens": 12, **params}), adapter=adapter)


def _teacher_forced(model, prompt, tokens, temperature):
    """Logprobs of ``tokens`` after ``prompt`` from one plain forward pass, at ``temperature``."""
    ids = torch.tensor([list(prompt) + list(tokens)])
    with torch.inference_mode():
        logits = model(ids).logits[0, len(prompt) - 1 : -1]  # [T, V]: the logits that predicted tokens
    lp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    return lp.gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1), lp


async def test_implements_the_protocol(engine, model_path):
    assert isinstance(engine, Engine)
    assert engine.kind == "transformers"
    assert engine.max_context == 2048
    assert engine.adapters() == []
    assert await engine.sleep() is False  # CPU: nothing to free
    await engine.wake()


async def test_greedy_matches_a_plain_argmax_loop(engine, reference):
    prompt = _prompt(engine)
    first, second = await asyncio.gather(
        engine.generate(_request(prompt, temperature=0)), engine.generate(_request(prompt, temperature=0))
    )
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(12):
            ids.append(int(reference(torch.tensor([ids])).logits[0, -1].argmax()))
    assert first[0].token_ids == second[0].token_ids == ids[len(prompt) :]
    assert first[0].finish_reason == "length"


async def test_seed_reproducible_whatever_the_batch(engine):
    prompt = _prompt(engine)
    alone = (await engine.generate(_request(prompt, temperature=1.0, seed=7)))[0].token_ids
    others = [_request(_prompt(engine, f"other {i} " * i), temperature=1.0) for i in range(5)]
    together = await asyncio.gather(
        *[engine.generate(r) for r in others[:3]],
        engine.generate(_request(prompt, temperature=1.0, seed=7)),
        *[engine.generate(r) for r in others[3:]],
    )
    assert together[3][0].token_ids == alone
    other_seed = (await engine.generate(_request(prompt, temperature=1.0, seed=8)))[0].token_ids
    assert other_seed != alone


async def test_n_completions(engine):
    params = {"temperature": 1.0, "seed": 3, "n": 3}
    completions = await engine.generate(_request(_prompt(engine), **params))
    assert [c.index for c in completions] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in completions}) == 3
    again = await engine.generate(_request(_prompt(engine), **params))
    assert [c.token_ids for c in again] == [c.token_ids for c in completions]


@pytest.mark.parametrize(("temperature", "top_p"), [(0.7, 0.9), (0.0, 1.0), (1.3, 1.0)])
async def test_logprobs_match_teacher_forcing(engine, reference, temperature, top_p):
    prompt = _prompt(engine, "Tell me about the weather in the city today.")
    params = {"temperature": temperature, "top_p": top_p, "seed": 1, "n": 2, "max_tokens": 16}
    completions, *_ = await asyncio.gather(  # batch mates with other lengths: padding must not leak
        engine.generate(_request(prompt, logprobs=True, **params)),
        engine.generate(_request(_prompt(engine, "hi"), temperature=1.0)),
        engine.generate(_request(_prompt(engine, "a much longer prompt " * 6), temperature=1.0)),
    )
    for c in completions:
        expected, _ = _teacher_forced(reference, prompt, c.token_ids, temperature)
        assert torch.allclose(torch.tensor(c.logprobs), expected, atol=1e-4)


async def test_top_logprobs(engine, reference):
    prompt = _prompt(engine)
    [c] = await engine.generate(_request(prompt, temperature=1.0, seed=2, logprobs=True, top_logprobs=20))
    _, full = _teacher_forced(reference, prompt, c.token_ids, 1.0)
    assert all(len(top) == 20 for top in c.top_logprobs)
    for position, (token, logprob, top) in enumerate(
        zip(c.token_ids, c.logprobs, c.top_logprobs, strict=True)
    ):
        values = [lp for _, lp in top]
        assert values == sorted(values, reverse=True)
        assert top[0][0] == int(full[position].argmax())
        for alt_token, alt_logprob in top:
            assert alt_logprob == pytest.approx(full[position, alt_token].item(), abs=1e-4)
        if logprob >= values[-1]:
            assert (token, logprob) in top
    [greedy] = await engine.generate(_request(prompt, temperature=0, logprobs=True, top_logprobs=3))
    assert all(
        top[0] == (t, lp)
        for t, lp, top in zip(greedy.token_ids, greedy.logprobs, greedy.top_logprobs, strict=True)
    )
    [none] = await engine.generate(_request(prompt, temperature=0, top_logprobs=3))
    assert none.top_logprobs == [[]] * 12 and len(none.logprobs) == 12


async def test_stop_strings_are_trimmed(engine):
    prompt = _prompt(engine)
    params = {"temperature": 1.0, "seed": 11, "max_tokens": 40}
    [full] = await engine.generate(_request(prompt, **params))
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 2]
    cut = full.text.index(stop)
    [stopped] = await engine.generate(_request(prompt, stop=(stop, "never-seen"), **params))
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[:cut]
    # Token ids run up to and including the token that completed the stop string.
    n = len(stopped.token_ids)
    assert stopped.token_ids == full.token_ids[:n]
    decode = engine.tokenizer.decode
    assert stop in decode(stopped.token_ids) and stop not in decode(stopped.token_ids[:-1])


async def test_max_tokens_and_eos(engine):
    prompt = _prompt(engine)
    [c] = await engine.generate(_request(prompt, temperature=0, max_tokens=5))
    assert len(c.token_ids) == 5 and c.finish_reason == "length"
    # Make the greedy continuation's third token an end of sequence: it ends the completion, is
    # kept in token_ids (it was sampled) and is not in the text.
    engine._eos_ids = engine._eos_ids | {c.token_ids[2]}
    [eos] = await engine.generate(_request(prompt, temperature=0, max_tokens=5))
    assert eos.token_ids == c.token_ids[: c.token_ids.index(c.token_ids[2]) + 1]
    assert eos.finish_reason == "stop"


async def test_stream_yields_what_generate_returns(engine):
    request = _request(_prompt(engine), temperature=1.0, seed=5, n=2, logprobs=True, top_logprobs=2)
    steps = [s async for s in engine.stream(request)]
    completions = await engine.generate(request)
    for c in completions:
        mine = [s for s in steps if s.index == c.index]
        assert [s.token_id for s in mine] == c.token_ids
        assert [s.logprob for s in mine] == c.logprobs
        assert [s.top_logprobs for s in mine] == c.top_logprobs
        assert [s.finish_reason for s in mine] == [None] * (len(mine) - 1) + [c.finish_reason]


async def test_concurrent_requests_share_forward_passes(engine):
    prompts = [_prompt(engine, f"question number {i} " * (i + 1)) for i in range(8)]
    alone = []
    before = engine.stats.forward_passes
    for p in prompts:
        alone.append((await engine.generate(_request(p, temperature=0, max_tokens=16)))[0].token_ids)
    serial = engine.stats.forward_passes - before
    before, batches = engine.stats.forward_passes, engine.stats.batches
    together = await asyncio.gather(
        *[engine.generate(_request(p, temperature=0, max_tokens=16)) for p in prompts]
    )
    batched = engine.stats.forward_passes - before
    assert serial == 8 * 16
    assert batched == 16 and engine.stats.batches - batches == 1
    assert [c[0].token_ids for c in together] == alone


async def test_max_batch_size_splits_batches(model_path):
    engine = TransformersEngine(model_path, max_batch_size=4)
    await engine.start()
    try:
        prompt = _prompt(engine)
        # Seeded: the third request would join the first batch if two of its rows ended early.
        requests = [_request(prompt, temperature=1.0, n=2, seed=i) for i in range(3)]
        await asyncio.gather(*[engine.generate(r) for r in requests])
        assert engine.stats.batches == 2
    finally:
        await engine.close()


async def test_a_stream_closed_early_frees_its_rows(engine):
    request = _request(_prompt(engine), temperature=0, max_tokens=2000)
    stream = engine.stream(request)
    async for _ in stream:
        break
    await stream.aclose()
    [c] = await engine.generate(_request(_prompt(engine), temperature=0, max_tokens=3))
    assert len(c.token_ids) == 3
    assert engine.stats.tokens < 1000


async def test_close_ends_running_and_waiting_requests(model_path):
    engine = TransformersEngine(model_path)
    await engine.start()
    prompt = _prompt(engine)
    running = engine.stream(_request(prompt, temperature=0, max_tokens=2000))
    await anext(running)  # its batch is decoding
    waiting = asyncio.create_task(engine.generate(_request(prompt, temperature=1.0, max_tokens=5)))
    await asyncio.sleep(0)
    await engine.close()
    with pytest.raises(EngineError, match="clos"):
        async for _ in running:
            pass
    with pytest.raises(EngineError, match="clos"):
        await waiting
    with pytest.raises(EngineError, match="closed"):
        await engine.generate(_request(prompt))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
async def test_sleep_frees_gpu_memory_and_wake_restores(model_path):
    engine = TransformersEngine(model_path, device="cuda")
    await engine.start()
    try:
        prompt = _prompt(engine)
        [before] = await engine.generate(_request(prompt, temperature=0))
        assert await engine.sleep() is True
        assert torch.cuda.memory_allocated() == 0
        pending = asyncio.create_task(engine.generate(_request(prompt, temperature=0)))
        await asyncio.sleep(0.05)
        assert not pending.done()  # requests wait while the engine sleeps
        await engine.wake()
        assert (await pending)[0].token_ids == before.token_ids
    finally:
        await engine.close()


async def test_adapter_changes_output_and_base_stays(engine, adapter_dir):
    prompt = _prompt(engine)
    [base] = await engine.generate(_request(prompt, temperature=0))
    await engine.load_adapter("tiny.v1@1", adapter_dir)
    assert engine.adapters() == ["tiny.v1@1"]
    tuned, base_again = await asyncio.gather(  # two batches, one per adapter
        engine.generate(_request(prompt, adapter="tiny.v1@1", temperature=0)),
        engine.generate(_request(prompt, temperature=0)),
    )
    assert tuned[0].token_ids != base.token_ids
    assert base_again[0].token_ids == base.token_ids
    await engine.load_adapter("other@2", adapter_dir)
    [other] = await engine.generate(_request(prompt, adapter="other@2", temperature=0))
    assert other.token_ids == tuned[0].token_ids
    await engine.unload_adapter("tiny.v1@1")
    assert engine.adapters() == ["other@2"]
    with pytest.raises(UnknownAdapter):
        await engine.generate(_request(prompt, adapter="tiny.v1@1"))
    await engine.unload_adapter("other@2")
    assert (await engine.generate(_request(prompt, temperature=0)))[0].token_ids == base.token_ids


async def test_unknown_adapter(engine):
    with pytest.raises(UnknownAdapter):
        await engine.generate(_request(_prompt(engine), adapter="nope@1"))
    with pytest.raises(UnknownAdapter):
        async for _ in engine.stream(_request(_prompt(engine), adapter="nope@1")):
            pass
    with pytest.raises(UnknownAdapter):
        await engine.unload_adapter("nope@1")


async def test_pickle_adapters_are_refused(engine, adapter_dir, tmp_path):
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (tmp_path / name).write_bytes((adapter_dir / name).read_bytes())
    (tmp_path / "adapter_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(EngineError, match="pickle"):
        await engine.load_adapter("evil@1", tmp_path)
    with pytest.raises(EngineError, match="does not exist"):
        await engine.load_adapter("missing@1", tmp_path / "missing")
    assert engine.adapters() == []


async def test_bad_requests(engine):
    with pytest.raises(EngineError, match="context"):
        await engine.generate(_request([1] * 2048))
    with pytest.raises(EngineError, match="empty"):
        await engine.generate(_request([]))
    with pytest.raises(EngineError):
        await engine.generate(_request(_prompt(engine), n=0))


async def test_a_preloaded_adapter_serves_what_a_load_serves(engine, adapter_dir):
    """``PreloadsAdapters``: the replica reads a staged step ahead and names it once saved."""
    assert isinstance(engine, PreloadsAdapters)
    prompt = _prompt(engine)
    await engine.load_adapter("loaded@1", adapter_dir)
    [loaded] = await engine.generate(_request(prompt, adapter="loaded@1", temperature=0))
    await engine.preload_adapter("ahead", adapter_dir)
    assert engine.adapters() == ["loaded@1"]  # read, serving nothing yet
    await engine.serve_preloaded("ahead@2", "ahead")
    [ahead] = await engine.generate(_request(prompt, adapter="ahead@2", temperature=0))
    assert ahead.token_ids == loaded.token_ids
    with pytest.raises(UnknownAdapter):
        await engine.serve_preloaded("again@3", "ahead")  # a key is served once
    await engine.preload_adapter("dropped", adapter_dir)
    await engine.drop_preloaded("dropped")
    with pytest.raises(UnknownAdapter):
        await engine.serve_preloaded("dropped@4", "dropped")


async def test_a_preload_cancelled_while_it_is_read_is_dropped(engine, adapter_dir):
    """The model thread cannot be stopped mid-read: the preload is dropped right after it."""
    lora = engine._lora
    reading, go_on = threading.Event(), threading.Event()
    read = lora.preload

    def slow_read(key, path):
        reading.set()
        go_on.wait(timeout=30)
        read(key, path)

    lora.preload = slow_read
    preloading = asyncio.create_task(engine.preload_adapter("staged", adapter_dir))
    assert await asyncio.to_thread(reading.wait, 30)
    preloading.cancel()
    go_on.set()
    with pytest.raises(asyncio.CancelledError):
        await preloading
    with pytest.raises(UnknownAdapter):  # runs on the model thread, after the drop
        await engine.serve_preloaded("staged@1", "staged")
    assert not hasattr(lora.model, "peft_config"), "the dropped preload's LoRA layers are still in"
