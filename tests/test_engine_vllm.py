"""The vLLM engine, for real: vllm-cpu serving SmolLM2-135M next to the transformers engine.

``make test-vllm`` runs this module (it builds ``.venv-vllm`` with ``make setup-vllm``, converts
SmolLM2 and sets ``ARTERY_TEST_VLLM=1``); anywhere else every test here is skipped, so ``make test``
stays fast. Two inference replicas of one model run as real processes, as ``Stack`` starts
them: one on the vLLM engine (from ``.venv-vllm``), one on the transformers engine (from this
interpreter). The same requests go to both:

- greedy decoding gives the same token ids (and the same rendered prompt) on chat, system,
  multi-turn and tools-in-the-prompt prompts;
- sampled completions carry a logprob for every token, within ``LOGPROB_TOLERANCE`` of the
  trainer's own recomputation (``policy.token_logprobs`` on the float32 model);
- a trainer-saved LoRA adapter, published to the Object Store, is hot-loaded by both and served
  as ``<model>@<step>`` with equal greedy output; a deleted step is unloaded, and one deleted
  while a request streams with it is unloaded once that request has finished (the engine lives);
- vLLM's worker stops polling its queue within milliseconds of its last batch, leaving the CPU
  to the trainer that pauses it;
- the contract tests: pause (requests wait) and resume, lease expiry, streaming, ``n``, stop
  strings, the OpenAI error shapes, ``/v1/models``;
- the default serving path: a ``LocalBackend`` given no engine serves SmolLM2 on vLLM-CPU in
  bfloat16, with the compilable LoRA ops, on a CPU with bf16 instructions (on the transformers
  engine on one without), and hot-loads a trainer adapter.

The parity replicas run in float32 (``ARTERY_INFERENCE_DTYPE``), the trainer's dtype; vLLM-CPU's
own default is bfloat16, whose logprobs the trainer corrects for (``test_sampler_mismatch.py``).

Sleep/wake: vLLM has no sleep mode on the CPU (its CPU worker ignores it), so the vLLM engine's
``sleep`` frees nothing there and returns False, as the transformers engine's does on the CPU; the
pause contract holds either way. On a GPU it sleeps at level 1 (not run here).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import time

import httpx
import pytest

import artery as art
from artery.ops.stack import VLLM_VENV, Stack
from artery.schemas import (
    CheckpointDeleted,
    CheckpointPublished,
    CheckpointSaved,
    CheckpointStaged,
    new_event_id,
)
from artery.services.trainer import announce
from artery.shared import bus, subjects, trainer_state
from artery.shared.adapters import pack_adapter, put_adapter, sha256_hex
from artery.shared.control_client import live_replicas, pause_replicas, resume_replicas
from artery.shared.cpu import cpu_has_bf16, cpu_has_fp16_weights
from artery.shared.embedded import NatsServer, free_port
from artery.shared.models import SMOLLM2, resolve_base_model
from artery.shared.settings import CommonSettings

#: ``make test-vllm`` sets it; there a missing ``.venv-vllm`` is an error, never a skip.
OPTED_IN = os.environ.get("ARTERY_TEST_VLLM") == "1"
if OPTED_IN and not (VLLM_VENV / ".installed").exists():
    raise RuntimeError("ARTERY_TEST_VLLM=1 but .venv-vllm is not set up: run `make setup-vllm`")
pytestmark = [
    pytest.mark.skipif(
        not OPTED_IN,
        reason="vLLM-CPU tests (~6 min, a 3.5 GB venv): run `make test-vllm`, which builds .venv-vllm",
    ),
    pytest.mark.timeout(900),
]

PROJECT, MODEL = "vl", "agent"
ENGINES = ("vllm", "transformers")
#: |sampler logprob - trainer logprob| per token. Both run SmolLM2 in float32 on the CPU, with
#: different kernels (vLLM's paged attention vs. eager attention): measured at most 3.4e-5 over
#: 4 x 24 sampled tokens at temperature 1.0 and 0.7; the tolerance leaves ~30x room.
LOGPROB_TOLERANCE = 1e-3
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
PROMPTS = {
    "user": {"messages": [{"role": "user", "content": "What is 2+2?"}]},
    "system": {
        "messages": [
            {"role": "system", "content": "You are a terse assistant. Answer in one sentence."},
            {"role": "user", "content": "Name three colors of the rainbow."},
        ]
    },
    "multi_turn": {
        "messages": [
            {"role": "user", "content": "My name is Ada."},
            {"role": "assistant", "content": "Nice to meet you, Ada!"},
            {"role": "user", "content": "What is my name?"},
        ]
    },
    "tools": {
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": [WEATHER_TOOL],
    },
}


# --------------------------------------------------------------------------- the two replicas


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    """NATS, and one replica per engine serving ``PROJECT/MODEL``: engine -> base URL."""
    home = tmp_path_factory.mktemp("vllm-stack")
    nats = NatsServer(home / "nats").start()
    stack = Stack(home=home / "stack", nats_url=nats.url, database_url="postgresql://unused")
    stack.home.mkdir(parents=True)
    stack.logs.mkdir()
    urls = {}
    try:
        asyncio.run(_provision(nats.url))
        for engine in ENGINES:
            port = free_port()
            urls[engine] = f"http://127.0.0.1:{port}"
            stack.start_service(
                f"inference-{engine}",
                service="inference",
                env={
                    **stack.replica_env(PROJECT, MODEL, SMOLLM2),
                    "ARTERY_INFERENCE_ENGINE": engine,
                    # The trainer's dtype: parity to the token (vLLM-CPU serves bf16 by default).
                    "ARTERY_INFERENCE_DTYPE": "float32",
                    "ARTERY_INFERENCE_REPLICA_ID": engine,
                    "ARTERY_INFERENCE_PORT": str(port),
                    "ARTERY_INFERENCE_HEARTBEAT_S": "1",
                },
            )
        for engine in ENGINES:
            stack.processes[f"inference-{engine}"].wait_ready(timeout=600)
        yield {"urls": urls, "nats_url": nats.url, "stack": stack}
    finally:
        stack.stop()
        nats.stop()


async def _provision(nats_url: str) -> None:
    nc = await bus.connect(CommonSettings(nats_url=nats_url), name="test-vllm")
    try:
        await bus.provision(nc.jetstream(), CommonSettings(nats_url=nats_url))
    finally:
        await nc.close()


@pytest.fixture
async def nc(replicas):
    client = await bus.connect(CommonSettings(nats_url=replicas["nats_url"]), name="test-vllm")
    yield client
    await client.close()


@pytest.fixture(scope="module")
def reference():
    """The trainer's view: SmolLM2 in float32 (what the trainer loads on the CPU) and its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(resolve_base_model(SMOLLM2), dtype=torch.float32)
    return model.eval()


async def chat(url: str, model: str = MODEL, **body) -> dict:
    body = {"model": model, "max_tokens": 32, "temperature": 0, **body}
    async with httpx.AsyncClient(timeout=300) as client:
        response = await client.post(f"{url}/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


async def both(replicas, **body) -> dict[str, dict]:
    results = await asyncio.gather(*(chat(replicas["urls"][e], **body) for e in ENGINES))
    return dict(zip(ENGINES, results, strict=True))


# --------------------------------------------------------------------------- parity


@pytest.mark.parametrize("prompt", sorted(PROMPTS))
async def test_greedy_tokens_match_the_transformers_engine(replicas, prompt):
    out = await both(replicas, **PROMPTS[prompt])
    vllm, hf = out["vllm"], out["transformers"]
    assert vllm["prompt_token_ids"] == hf["prompt_token_ids"]  # the same chat template, rendered alike
    assert vllm["choices"][0]["token_ids"] == hf["choices"][0]["token_ids"]
    assert vllm["choices"][0]["message"]["content"] == hf["choices"][0]["message"]["content"]
    assert vllm["choices"][0]["finish_reason"] == hf["choices"][0]["finish_reason"]
    assert vllm["model"] == hf["model"]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
async def test_sampled_logprobs_cover_every_token_and_match_the_trainer(replicas, reference, temperature):
    import torch

    from artery.services.trainer.policy import token_logprobs

    response = await chat(
        replicas["urls"]["vllm"],
        **PROMPTS["system"],
        temperature=temperature,
        n=4,
        seed=7,
        max_tokens=24,
        logprobs=True,
    )
    prompt = response["prompt_token_ids"]
    assert len(response["choices"]) == 4
    worst = 0.0
    for choice in response["choices"]:
        ids = choice["token_ids"]
        entries = choice["logprobs"]["content"]
        assert ids and len(entries) == len(ids)
        assert [e["token_id"] for e in entries] == ids
        sampled = torch.tensor([e["logprob"] for e in entries])
        assert all(math.isfinite(v) and v <= 0 for v in sampled.tolist())
        with torch.no_grad():
            logits = reference(input_ids=torch.tensor([prompt + ids])).logits  # [1, P+T, V]
        positions = logits[:, len(prompt) - 1 : -1]  # [1, T, V]: each predicts the next token
        recomputed = token_logprobs(positions, torch.tensor([ids]), temperature)[0]  # [T]
        worst = max(worst, float((recomputed - sampled).abs().max()))
    print(f"temperature {temperature}: largest |sampler - trainer| logprob difference {worst:.2e}")
    assert worst <= LOGPROB_TOLERANCE, worst


async def test_n_seed_top_logprobs_and_stop(replicas):
    url = replicas["urls"]["vllm"]
    first = await chat(url, **PROMPTS["user"], temperature=1.0, n=3, seed=11, max_tokens=12)
    again = await chat(url, **PROMPTS["user"], temperature=1.0, n=3, seed=11, max_tokens=12)
    assert [c["token_ids"] for c in first["choices"]] == [c["token_ids"] for c in again["choices"]]
    assert [c["index"] for c in first["choices"]] == [0, 1, 2]
    top = await chat(url, **PROMPTS["user"], logprobs=True, top_logprobs=3, max_tokens=6)
    for entry in top["choices"][0]["logprobs"]["content"]:
        alternatives = entry["top_logprobs"]
        assert len(alternatives) == 3
        assert alternatives[0]["logprob"] >= alternatives[-1]["logprob"]
        assert entry["logprob"] >= alternatives[-1]["logprob"] - 1e-6
    out = await both(replicas, **PROMPTS["user"], stop=["answer"])
    for engine in ENGINES:
        choice = out[engine]["choices"][0]
        assert "answer" not in choice["message"]["content"]
        assert choice["finish_reason"] == "stop"
    assert out["vllm"]["choices"][0]["token_ids"] == out["transformers"]["choices"][0]["token_ids"]


async def test_many_seeded_requests_with_long_prompts_at_once(replicas):
    """More prompt tokens at once than one step takes (vLLM's 2048): with chunked prefill, a
    seeded request split across steps killed vllm-cpu's engine core; the engine turns it off."""
    url = replicas["urls"]["vllm"]
    text = "write one short sentence in lowercase about the sea and the sky. " * 8
    results = await asyncio.gather(
        *(
            chat(
                url,
                messages=[{"role": "user", "content": f"Question {i}: {text}"}],
                temperature=1.0,
                seed=i,
                max_tokens=8,
            )
            for i in range(40)
        )
    )
    assert sum(len(r["prompt_token_ids"]) for r in results) > 4096
    assert all(r["choices"][0]["token_ids"] for r in results)
    assert (await chat(url, **PROMPTS["user"], max_tokens=2))["choices"][0]["token_ids"]  # still alive


# --------------------------------------------------------------------------- contract, both engines


@pytest.mark.parametrize("engine", ENGINES)
async def test_streaming_assembles_the_greedy_answer(replicas, engine):
    url = replicas["urls"][engine]
    whole = await chat(url, **PROMPTS["user"])
    body = {
        "model": MODEL,
        **PROMPTS["user"],
        "max_tokens": 32,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    text, ids, usage = "", [], None
    async with (
        httpx.AsyncClient(timeout=300) as client,
        client.stream("POST", f"{url}/v1/chat/completions", json=body) as response,
    ):
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk["choices"]:
                text += choice["delta"].get("content") or ""
                ids += choice.get("token_ids") or []
    assert text == whole["choices"][0]["message"]["content"]
    assert ids == whole["choices"][0]["token_ids"]
    assert usage["completion_tokens"] == len(ids)


@pytest.mark.parametrize("engine", ENGINES)
async def test_openai_error_shapes(replicas, engine):
    url = replicas["urls"][engine]
    async with httpx.AsyncClient(timeout=300) as client:
        post = f"{url}/v1/chat/completions"
        unknown = await client.post(post, json={"model": f"{MODEL}@7", **PROMPTS["user"]})
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
        bad = await client.post(post, json={"model": MODEL, **PROMPTS["user"], "temperature": 5})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature"
        models = (await client.get(f"{url}/v1/models")).json()
        context = models["data"][0]["max_model_len"]
        long = [{"role": "user", "content": "hello " * (context + 10)}]
        too_long = await client.post(post, json={"model": MODEL, "messages": long})
        assert too_long.status_code == 400
        assert too_long.json()["error"]["code"] == "context_length_exceeded"
    assert {m["id"] for m in models["data"]} >= {MODEL, f"{MODEL}@0"}


async def test_pause_holds_requests_on_both_engines_until_resume(replicas, nc):
    outcome = await pause_replicas(nc, PROJECT, MODEL, lease_seconds=60, requested_by="test", timeout_s=20)
    assert sorted(outcome.acked) == sorted(ENGINES) and not outcome.missing
    started = time.monotonic()
    pending = [
        asyncio.create_task(chat(replicas["urls"][e], **PROMPTS["user"], max_tokens=4)) for e in ENGINES
    ]
    await asyncio.sleep(1.0)
    assert not any(task.done() for task in pending), "requests must wait while paused"
    resumed = await resume_replicas(nc, PROJECT, MODEL, outcome.lease_id, requested_by="test")
    assert sorted(resumed.acked) == sorted(ENGINES)
    results = await asyncio.gather(*pending)
    assert all(r["choices"][0]["token_ids"] for r in results)
    assert time.monotonic() - started >= 1.0


async def test_a_lease_that_runs_out_resumes_both_engines(replicas, nc):
    outcome = await pause_replicas(nc, PROJECT, MODEL, lease_seconds=2, requested_by="dead-trainer")
    assert sorted(outcome.acked) == sorted(ENGINES)
    started = time.monotonic()
    results = await asyncio.gather(
        *(chat(replicas["urls"][e], **PROMPTS["user"], max_tokens=4) for e in ENGINES)
    )
    waited = time.monotonic() - started
    assert all(r["choices"][0]["token_ids"] for r in results)
    assert 1.0 <= waited < 30, waited


# --------------------------------------------------------------------------- adapters


def trainer_adapter(directory, seed: int = 0) -> bytes:
    """An adapter saved by the trainer's ``Policy`` (its default LoRA: r 8, attention, MLP and
    ``lm_head``), its B matrices moved off zero (by ``seed``) so that it changes greedy output."""
    import torch

    from artery.services.trainer.policy import Policy

    policy = Policy.create(SMOLLM2)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in policy.named_trainable:
            if "lora_B" in name:
                parameter.normal_(0, 0.05, generator=generator)
    return pack_adapter(Policy.adapter_dir(policy.save(directory)))


async def publish_adapter(js, step: int, data: bytes) -> str:
    """The adapter in the Object Store and its ``CheckpointPublished`` event; its object name."""
    object_name = f"{PROJECT}/{MODEL}/{step:04d}"
    await put_adapter(js, object_name, data)
    await bus.publish_event(
        js,
        subjects.checkpoint("published", PROJECT, MODEL),
        CheckpointPublished(
            id=new_event_id(),
            project=PROJECT,
            model=MODEL,
            step=step,
            object_name=object_name,
            sha256=sha256_hex(data),
            size_bytes=len(data),
            base_model=SMOLLM2,
            served_name=f"{MODEL}@{step}",
        ),
    )
    return object_name


async def delete_adapter(js, step: int, object_name: str) -> None:
    """What retention (or ``model.delete_checkpoints``) announces for a deleted step."""
    await bus.publish_event(
        js,
        subjects.checkpoint("deleted", PROJECT, MODEL),
        CheckpointDeleted(
            id=new_event_id(), project=PROJECT, model=MODEL, step=step, object_name=object_name
        ),
    )


async def served_everywhere(js, name: str, present: bool = True) -> bool:
    live = await live_replicas(js, PROJECT, MODEL)
    return len(live) == len(ENGINES) and all((name in r.served) == present for r in live)


async def test_a_trainer_adapter_is_hot_loaded_and_matches_the_transformers_engine(replicas, nc, tmp_path):
    js = nc.jetstream()
    before = await both(replicas, **PROMPTS["user"])
    data = await asyncio.to_thread(trainer_adapter, tmp_path / "checkpoint")
    object_name = await publish_adapter(js, 1, data)
    await _wait(lambda: served_everywhere(js, f"{MODEL}@1"), timeout=120)
    after = await both(replicas, **PROMPTS["user"], model=f"{MODEL}@1")
    latest = await both(replicas, **PROMPTS["user"])
    base = await both(replicas, **PROMPTS["user"], model=f"{MODEL}@0")
    ids = {
        k: {e: r[e]["choices"][0]["token_ids"] for e in ENGINES}
        for k, r in {"before": before, "after": after, "latest": latest, "base": base}.items()
    }
    assert ids["after"]["vllm"] == ids["after"]["transformers"]  # the adapter, served alike
    assert ids["after"]["vllm"] != ids["before"]["vllm"]  # and it changes the output
    assert ids["latest"] == ids["after"] and latest["vllm"]["model"] == f"{MODEL}@1"
    assert ids["base"] == ids["before"]
    # The adapter and the base model in one batch: each row gets its own (vLLM-CPU's compiled
    # LoRA groups the rows of a batch by adapter at every step).
    mixed = await asyncio.gather(
        *(both(replicas, **PROMPTS["user"], model=f"{MODEL}@{step}") for step in (1, 0, 1, 0))
    )
    for step, result in zip((1, 0, 1, 0), mixed, strict=True):
        want = ids["after" if step else "base"]
        assert {e: result[e]["choices"][0]["token_ids"] for e in ENGINES} == want

    # Retention deletes the step: both replicas unload it.
    await delete_adapter(js, 1, object_name)
    await _wait(lambda: served_everywhere(js, f"{MODEL}@1", present=False), timeout=60)
    async with httpx.AsyncClient(timeout=60) as client:
        gone = await client.post(
            f"{replicas['urls']['vllm']}/v1/chat/completions",
            json={"model": f"{MODEL}@1", **PROMPTS["user"], "max_tokens": 2},
        )
    assert gone.status_code == 404


async def stored_as_trainer_does(js, step: int, data: bytes) -> dict:
    """The adapter in the trainer-state store; what ``checkpoint.staged`` and ``.saved`` say of it."""
    name = trainer_state.object_name(PROJECT, MODEL, step, trainer_state.ADAPTER)
    await trainer_state.put(js, name, data)
    return dict(
        project=PROJECT,
        model=MODEL,
        step=step,
        uri=trainer_state.uri(name),
        sha256=sha256_hex(data),
        size_bytes=len(data),
        base_model=SMOLLM2,
    )


def replica_log(replicas, engine: str) -> str:
    return (replicas["stack"].logs / f"inference-{engine}.log").read_text()


async def test_a_staged_adapter_read_ahead_by_vllm_serves_once_saved_and_stale_bytes_never(
    replicas, nc, tmp_path
):
    """The trainer stages a step's adapter before its state is stored: the vLLM replica reads it
    into vLLM ahead (``preload_adapter``) and serves that id once the step is saved, with the
    transformers engine's tokens. A step trained again into other bytes after it was read ahead
    serves the saved bytes, never the ones read ahead."""
    js = nc.jetstream()
    # One at a time: loading two models at once in threads is not safe in transformers.
    first, staged, saved = [await asyncio.to_thread(trainer_adapter, tmp_path / str(s), s) for s in (1, 2, 3)]
    steps = (21, 22)
    try:
        fields = await stored_as_trainer_does(js, 21, first)
        await announce.stage(js, CheckpointStaged(id=new_event_id(), **fields))
        await bus.publish_event(js, subjects.checkpoint("saved", PROJECT, MODEL), saved_as(fields))
        await _wait(lambda: served_everywhere(js, f"{MODEL}@21"), timeout=120)
        assert read_ahead(replicas, f"{MODEL}@21") is True
        one = await both(replicas, **PROMPTS["user"], model=f"{MODEL}@21")
        assert one["vllm"]["choices"][0]["token_ids"] == one["transformers"]["choices"][0]["token_ids"]

        fields = await stored_as_trainer_does(js, 22, staged)
        await announce.stage(js, CheckpointStaged(id=new_event_id(), **fields))
        await _wait(lambda: fetched_ahead_by_vllm(replicas, 22), timeout=120)
        fields = await stored_as_trainer_does(js, 22, saved)  # trained again: other bytes, same step
        await bus.publish_event(js, subjects.checkpoint("saved", PROJECT, MODEL), saved_as(fields))
        await _wait(lambda: served_everywhere(js, f"{MODEL}@22"), timeout=120)
        assert read_ahead(replicas, f"{MODEL}@22") is False
        two = await both(replicas, **PROMPTS["user"], model=f"{MODEL}@22")
        assert two["vllm"]["choices"][0]["token_ids"] == two["transformers"]["choices"][0]["token_ids"]
        assert two["vllm"]["choices"][0]["token_ids"] != one["vllm"]["choices"][0]["token_ids"]
    finally:
        for step in steps:
            await delete_adapter(js, step, f"{PROJECT}/{MODEL}/{step:04d}")
        for step in steps:
            await _wait(lambda step=step: served_everywhere(js, f"{MODEL}@{step}", present=False), timeout=60)


async def test_a_step_republished_with_other_bytes_reuses_no_prompt_cache_of_the_bytes_before(
    replicas, nc, tmp_path
):
    """vLLM keeps a prompt's KV blocks for later prompts with the same prefix, keyed by the
    adapter's name and path. A step re-published with other bytes is served under the same served
    name from the same directory; its prompts must not reuse blocks computed with the bytes
    before (``vllm_engine._vllm_name``)."""
    js = nc.jetstream()
    before, after = [await asyncio.to_thread(trainer_adapter, tmp_path / str(s), s) for s in (4, 5)]
    # Several of vLLM's KV blocks long, so that its prefix cache holds whole blocks of it.
    story = " ".join(f"Line {i}: the fox ran past the old mill and into the wood." for i in range(60))
    prompt = {"messages": [{"role": "user", "content": f"{story}\nWhat did the fox do?"}], "max_tokens": 8}
    name = f"{MODEL}@31"
    object_name = await publish_adapter(js, 31, before)
    try:
        await _wait(lambda: served_everywhere(js, name), timeout=120)
        first = await both(replicas, **prompt, model=name)  # the prompt's blocks, with ``before``
        await publish_adapter(js, 31, after)
        await _wait(lambda: loaded_everywhere(replicas, name, sha256_hex(after)), timeout=120)
        again = await both(replicas, **prompt, model=name)
        tokens = {e: again[e]["choices"][0]["token_ids"] for e in ENGINES}
        assert tokens["vllm"] == tokens["transformers"]
        assert tokens["transformers"] != first["transformers"]["choices"][0]["token_ids"]  # the bytes matter
    finally:
        await delete_adapter(js, 31, object_name)
        await _wait(lambda: served_everywhere(js, name, present=False), timeout=60)


async def loaded_everywhere(replicas, name: str, sha256: str) -> bool:
    """Whether each replica's newest load of ``name`` (its log) is of ``sha256``."""
    for engine in ENGINES:
        loads = [e for e in log_events(replicas, engine, "adapter loaded") if e.get("served_name") == name]
        if not loads or loads[-1].get("sha256") != sha256:
            return False
    return True


def saved_as(fields: dict) -> CheckpointSaved:
    return CheckpointSaved(id=new_event_id(), metrics={}, **fields)


def log_events(replicas, engine: str, event: str) -> list[dict]:
    """The replica's log lines (JSON) of ``event``."""
    lines = [json.loads(line) for line in replica_log(replicas, engine).splitlines() if line.startswith("{")]
    return [e for e in lines if e.get("event") == event]


def read_ahead(replicas, name: str) -> bool | None:
    """Whether the vLLM replica served ``name`` from what its engine had read ahead (its log)."""
    loads = [e for e in log_events(replicas, "vllm", "adapter loaded") if e.get("served_name") == name]
    return loads[-1]["read_ahead"] if loads else None


async def fetched_ahead_by_vllm(replicas, step: int) -> bool:
    return any(e.get("step") == step for e in log_events(replicas, "vllm", "staged adapter fetched ahead"))


async def test_a_base_model_request_gets_no_adapter_with_every_lora_slot_taken(replicas, nc, tmp_path):
    """vLLM-CPU marks a row without an adapter with slot index -1, which its kernels read as the
    last of the ``max_loras`` slots (torch indexing). With four adapters resident, a base-model
    request (another tenant's, on a shared replica) decoded with the fourth one's. Artery's LoRA
    ops give such rows nothing."""
    js = nc.jetstream()
    url = replicas["urls"]["vllm"]
    base = await chat(url, **PROMPTS["user"], model=f"{MODEL}@0")
    data = await asyncio.to_thread(trainer_adapter, tmp_path / "checkpoint")
    steps = (11, 12, 13, 14)  # as many as the replica's LoRA slots (VLLMEngine's max_loras)
    names = []
    try:
        for step in steps:  # one by one: a replica loads the newest step, skipping older ones waiting
            names.append(await publish_adapter(js, step, data))
            await _wait(lambda step=step: served_everywhere(js, f"{MODEL}@{step}"), timeout=120)
        adapted = await asyncio.gather(*(chat(url, **PROMPTS["user"], model=f"{MODEL}@{s}") for s in steps))
        assert all(a["choices"][0]["token_ids"] != base["choices"][0]["token_ids"] for a in adapted)
        again = await chat(url, **PROMPTS["user"], model=f"{MODEL}@0")  # every slot now holds one
        assert again["choices"][0]["token_ids"] == base["choices"][0]["token_ids"]
    finally:
        published = steps[: len(names)]
        for step, object_name in zip(published, names, strict=True):
            await delete_adapter(js, step, object_name)
        for step in published:
            await _wait(lambda step=step: served_everywhere(js, f"{MODEL}@{step}", present=False), timeout=60)


async def test_a_step_deleted_while_it_streams_finishes_and_the_engine_lives_on(replicas, nc, tmp_path):
    """Retention deletes a step while a request is generating with it (asynchronous training does
    this every step: the rollouts one step behind are still running). vLLM reloads an adapter from
    its directory whenever a scheduled request needs it back in a LoRA slot, so removing it and
    its files under a running request used to kill vLLM's engine, and the replica with it, for
    every model it served. The replica now unloads a step once its requests have finished."""
    js = nc.jetstream()
    url = replicas["urls"]["vllm"]
    data = await asyncio.to_thread(trainer_adapter, tmp_path / "checkpoint")
    object_name = await publish_adapter(js, 2, data)
    await _wait(lambda: served_everywhere(js, f"{MODEL}@2"), timeout=120)
    body = {
        "model": f"{MODEL}@2",
        "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}],
        "max_tokens": 160,
        "temperature": 0,
    }
    whole = await chat(url, **body)
    # Greedy, so the streamed request below generates exactly this many tokens: long enough that
    # the deletion reaches the replica while it is still generating.
    assert whole["choices"][0]["finish_reason"] == "length", whole["choices"][0]

    ids, deleted = [], False
    async with (
        httpx.AsyncClient(timeout=300) as client,
        client.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}) as response,
    ):
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            assert "error" not in chunk, chunk
            if not deleted:  # generation has begun: delete the step under the running request
                await delete_adapter(js, 2, object_name)
                deleted = True
            for choice in chunk["choices"]:
                ids += choice.get("token_ids") or []
    assert ids == whole["choices"][0]["token_ids"]

    await _wait(lambda: served_everywhere(js, f"{MODEL}@2", present=False), timeout=60)
    after = await chat(url, **PROMPTS["user"], max_tokens=4)  # the engine still serves
    assert after["choices"][0]["token_ids"]


async def test_an_idle_vllm_worker_leaves_the_cpu_to_the_trainer(replicas):
    """vLLM's worker polls its queue for a second after its last read (``SpinCondition``), which
    took a core from every training step's start; ``vllm_cpu_worker`` parks it within 20 ms."""
    psutil = pytest.importorskip("psutil")  # a dependency of vLLM, in .venv-vllm
    replica = psutil.Process(replicas["stack"].processes["inference-vllm"].popen().pid)
    workers = [p for p in replica.children(recursive=True) if p.name().startswith("VLLM::Worker")]
    assert workers, "no vLLM worker process under the replica"

    def cpu_s() -> float:
        return sum(sum(w.cpu_times()[:2]) for w in workers)  # user + system

    await chat(replicas["urls"]["vllm"], messages=[{"role": "user", "content": "Say hi."}])
    await asyncio.sleep(0.2)  # past the short spin, within vLLM's own second of it
    before = cpu_s()
    await asyncio.sleep(0.6)
    used = cpu_s() - before
    # Polling, the worker would use most of a core in that time (it yields, so less under load).
    assert used < 0.15, f"the idle vLLM worker used {used:.2f} s of CPU in 0.6 s"


def test_the_vllm_replica_warmed_up_on_a_short_batch(replicas):
    """vLLM-CPU's worker runs the model once before it says ready, on its whole token budget
    (8,192 here): seconds at every start, for nothing the CPU needs. ``vllm_cpu_worker`` caps it.
    The replica's log says so, and the compiled graph that short pass loaded serves the long
    batches of ``test_many_seeded_requests_with_long_prompts_at_once``."""
    from artery.services.inference.engine.vllm_cpu_worker import WARMUP_TOKENS

    log = (replicas["stack"].logs / "inference-vllm.log").read_text()
    assert f"warm-up pass of {WARMUP_TOKENS} tokens, not vLLM's 8192" in log


def test_vllms_processes_end_when_their_replica_is_killed(replicas):
    """A replica SIGKILLed (or OOM-killed) stops nothing itself: vLLM's engine core and worker end
    anyway (``vllm_cpu_worker.end_with_the_replica``), rather than hold the model's memory."""
    psutil = pytest.importorskip("psutil")  # a dependency of vLLM, in .venv-vllm
    stack = replicas["stack"]
    stack.start_service(
        "inference-killed",
        service="inference",
        env={
            **stack.replica_env(PROJECT, MODEL, SMOLLM2),
            "ARTERY_INFERENCE_ENGINE": "vllm",
            "ARTERY_INFERENCE_DTYPE": "float32",  # the fixture's replica's: its compiled model loads
            "ARTERY_INFERENCE_REPLICA_ID": "killed",
            "ARTERY_INFERENCE_PORT": str(free_port()),
        },
    )
    process = stack.processes["inference-killed"]
    process.wait_ready(timeout=600)
    replica = psutil.Process(process.popen().pid)
    vllm_processes = replica.children(recursive=True)
    assert any(p.name().startswith("VLLM::Worker") for p in vllm_processes), vllm_processes
    replica.kill()
    _, alive = psutil.wait_procs(vllm_processes, timeout=60)
    for leftover in alive:
        leftover.kill()
    assert not alive, f"outlived their replica: {[p.name() for p in alive]}"


#: Run by vLLM's interpreter: the config the engine starts vLLM with, and the compilation mode the
#: platform itself chose for it (vllm-cpu: none, since LoRA is on).
CONFIG_PROBE = """
import json, sys
from vllm import AsyncEngineArgs
from artery.services.inference.engine.vllm_engine import VLLMEngine
engine = VLLMEngine(sys.argv[1], engine_args=json.loads(sys.argv[2]))
platform = AsyncEngineArgs(**engine.engine_args()).create_engine_config().compilation_config
started = engine.engine_config().compilation_config
print(json.dumps([platform.mode.name, started.mode.name]))
"""


@pytest.mark.parametrize(
    "engine_args, modes",
    [({}, ["NONE", "DYNAMO_TRACE_ONCE"]), ({"enforce_eager": True}, ["NONE", "NONE"])],
    ids=["default", "enforce_eager"],
)
def test_lora_serving_on_the_cpu_is_compiled_unless_eager_is_asked(engine_args, modes):
    """vllm-cpu serves eagerly whenever LoRA is on; the engine compiles it (the parity, hot-load and
    mixed-batch tests above run on the compiled replica), and ``enforce_eager`` is obeyed."""
    assert config_probe(CONFIG_PROBE, engine_args) == modes


def config_probe(script: str, engine_args: dict, env: dict[str, str] | None = None):
    """What ``script`` prints last (JSON), run by vLLM's interpreter on SmolLM2 with
    ``engine_args``, in this environment without ``VLLM_CPU_KVCACHE_SPACE`` plus ``env``."""
    probe = subprocess.run(
        [
            str(VLLM_VENV / "bin" / "python"),
            "-c",
            script,
            resolve_base_model(SMOLLM2),
            json.dumps(engine_args),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"} | (env or {}),
    )
    assert probe.returncode == 0, probe.stderr[-3000:]
    return json.loads(probe.stdout.strip().splitlines()[-1])


#: Run by vLLM's interpreter: the KV cache size of the config the engine starts vLLM with.
KV_CACHE_PROBE = """
import json, sys
from artery.services.inference.engine.vllm_engine import VLLMEngine
engine = VLLMEngine(sys.argv[1], engine_args=json.loads(sys.argv[2]))
print(json.dumps(engine.engine_config().cache_config.kv_cache_memory_bytes))
"""


@pytest.mark.parametrize(
    "engine_args, env, size",
    [
        ({}, {}, 720 << 20),  # four contexts of SmolLM2 in bf16 (vllm_cpu_kv_cache)
        ({}, {"VLLM_CPU_KVCACHE_SPACE": "1"}, 1 << 30),
        ({"kv_cache_memory_bytes": 300 << 20}, {}, 300 << 20),
    ],
    ids=["default", "env", "engine_args"],
)
def test_the_cpus_kv_cache_is_the_models_size_unless_one_is_given(engine_args, env, size):
    """The replica's start allocates the whole KV cache: by default the model's need, not a fixed
    2 GiB; ``VLLM_CPU_KVCACHE_SPACE`` or ``kv_cache_memory_bytes`` are obeyed as given."""
    assert config_probe(KV_CACHE_PROBE, engine_args, env) == size


#: Run by vLLM's interpreter: the engine on ``argv[1]`` (float32, the trainer's dtype) loads the
#: adapter ``argv[2]`` and samples from prompt ``argv[3]`` under it.
ADAPTER_PROBE = """
import asyncio, json, sys
from pathlib import Path
from artery.services.inference.engine.base import GenerationRequest, SamplingParams
from artery.services.inference.engine.vllm_engine import VLLMEngine

async def main(model, adapter, prompt):
    engine = VLLMEngine(model, dtype="float32")
    await engine.start()
    try:
        await engine.load_adapter("qwen2@1", Path(adapter))
        params = SamplingParams(max_tokens=8, temperature=1.0, logprobs=True, seed=7)
        (tuned,) = await engine.generate(GenerationRequest(prompt, params, adapter="qwen2@1"))
        print("SERVED " + json.dumps({"token_ids": tuned.token_ids, "logprobs": tuned.logprobs}))
    finally:
        await engine.close()

if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3])))
"""


def test_a_qwen2_adapter_on_lm_head_is_served_with_it(tmp_path):
    """vLLM's Qwen2 class (Qwen2.5's) lists no LoRA on ``lm_head``, so vLLM refused the trainer's
    default adapter whole, here (0.32) and on an H200 (0.24); ``vllm_lora_targets`` declares it.
    On a Qwen2 of head size 64 (the smallest vLLM-CPU serves) with the trainer's adapter, every B
    moved off zero: the logprobs vLLM samples with are the PEFT model's, and far from those of
    the same adapter without its ``lm_head`` LoRA."""
    import torch

    from artery.services.trainer.policy import Policy
    from artery.shared.tiny_model import build_tiny_model
    from tests.test_gpu import teacher_forced

    model_dir = build_tiny_model(tmp_path / "qwen2", hidden_size=128, num_heads=2, num_kv_heads=1)
    policy = Policy.create(str(model_dir))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in policy.named_trainable:
            if "lora_B" in name:
                parameter.normal_(0, 0.05, generator=generator)
    adapter = Policy.adapter_dir(policy.save(tmp_path / "checkpoint"))
    assert "lm_head" in json.loads((adapter / "adapter_config.json").read_text())["target_modules"]
    probe = tmp_path / "probe.py"
    probe.write_text(ADAPTER_PROBE)
    prompt = [1, 5, 9, 20, 33]
    run = subprocess.run(
        [str(VLLM_VENV / "bin" / "python"), str(probe), str(model_dir), str(adapter), json.dumps(prompt)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [line for line in run.stdout.splitlines() if line.startswith("SERVED ")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    served = json.loads(lines[0].removeprefix("SERVED "))
    sampled = torch.tensor(served["logprobs"])

    policy.model.eval()
    tuned = teacher_forced(policy.model, prompt, served["token_ids"])
    with torch.no_grad():
        for name, parameter in policy.named_trainable:
            if "lm_head" in name and "lora_B" in name:
                parameter.zero_()
    without_head = teacher_forced(policy.model, prompt, served["token_ids"])
    near = float((tuned - sampled).abs().max())
    far = float((without_head - sampled).abs().max())
    assert near <= LOGPROB_TOLERANCE, (near, far)
    assert far > 10 * LOGPROB_TOLERANCE, (near, far)


async def _wait(predicate, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        assert time.monotonic() < deadline, f"not met within {timeout}s"
        await asyncio.sleep(0.2)


# --------------------------------------------------------------------------- the default serving path


async def test_local_backend_serves_smollm2_on_the_cpus_default_engine_and_hot_loads_an_adapter(
    tmp_path, monkeypatch
):
    """Also ``make compile-model`` (``artery.ops.engine_warmup``), into an empty vLLM cache: the
    replica then loads the compile of set-up instead of compiling at its start."""
    from artery.ops.engine_warmup import warm

    compiled = tmp_path / "vllm-cache" / "torch_compile_cache" / "torch_aot_compile"
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "vllm-cache"))  # for the replica too
    assert await asyncio.to_thread(warm, SMOLLM2, dict(os.environ)) == 0
    backend = art.LocalBackend(path=tmp_path / "local", services=("publisher",))
    model = art.TrainableModel(name="dflt", project=PROJECT, base_model=SMOLLM2)
    try:
        await model.register(backend)
        choice = backend.engines[(PROJECT, "dflt")]
        replica = backend.stack.processes[f"inference-{PROJECT}-dflt"]
        if cpu_has_bf16():
            assert (choice.engine, choice.dtype, choice.tis_cap) == ("vllm", "bfloat16", 2.0)
            assert replica.python == str(VLLM_VENV / "bin" / "python")
            log = replica.log_path.read_text()
            assert "dtype=torch.bfloat16" in log
            assert "CpuWorkerExtension" in log  # vLLM imported the kernels' module in its worker
            [entry] = list(compiled.iterdir())  # the set-up's compile, the only one
            assert f"Directly load AOT compilation from path {entry}" in log
            assert "saved AOT compiled function" not in log
        else:  # bf16 matmuls take a slow path on this CPU: the transformers engine serves,
            # with fp16 weights where fbgemm runs them (the trainer then corrects its samples)
            expected = ("float16", 2.0) if cpu_has_fp16_weights() else (None, None)
            assert (choice.engine, choice.dtype, choice.tis_cap) == ("transformers", *expected)
            assert "no bf16 instructions" in choice.reason
            assert not compiled.exists()  # nothing compiled ahead for it
        url = model.inference_base_url.removesuffix("/v1")
        before = await chat(url, model="dflt", **PROMPTS["user"])
        assert before["choices"][0]["token_ids"]

        nc = await bus.connect(CommonSettings(nats_url=backend.stack.nats_url), name="test-vllm-default")
        try:
            js = nc.jetstream()
            data = await asyncio.to_thread(trainer_adapter, tmp_path / "checkpoint")
            object_name = f"{PROJECT}/dflt/0001"
            await put_adapter(js, object_name, data)
            await bus.publish_event(
                js,
                subjects.checkpoint("published", PROJECT, "dflt"),
                CheckpointPublished(
                    id=new_event_id(),
                    project=PROJECT,
                    model="dflt",
                    step=1,
                    object_name=object_name,
                    sha256=sha256_hex(data),
                    size_bytes=len(data),
                    base_model=SMOLLM2,
                    served_name="dflt@1",
                ),
            )

            async def served() -> bool:
                return any("dflt@1" in r.served for r in await live_replicas(js, PROJECT, "dflt"))

            await _wait(served, timeout=120)
        finally:
            await nc.close()
        after = await chat(url, model="dflt@1", **PROMPTS["user"], logprobs=True)
        assert after["model"] == "dflt@1"
        assert after["choices"][0]["token_ids"] != before["choices"][0]["token_ids"]
        entries = after["choices"][0]["logprobs"]["content"]
        assert len(entries) == len(after["choices"][0]["token_ids"])
        assert all(math.isfinite(e["logprob"]) for e in entries)
    finally:
        await backend.close()
