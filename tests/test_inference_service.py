"""Inference replicas as real processes: pause/resume across replicas, leases, adapter hot-load."""

from __future__ import annotations

import asyncio
import time

import openai
import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from artery.schemas import CheckpointPublished, new_event_id
from artery.shared import subjects
from artery.shared.adapters import pack_adapter, put_adapter, sha256_hex
from artery.shared.bus import publish_event
from artery.shared.control_client import live_replicas, pause_replicas, resume_replicas
from artery.shared.models import TINY, resolve_base_model
from tests.helpers import wait_for

pytestmark = pytest.mark.timeout(240)
PROJECT, MODEL = "inf", "agent"
PROMPT = [{"role": "user", "content": "count to three"}]


def start_replica(stack, name: str, **env) -> None:
    stack.start_service(
        name,
        service="inference",
        env={
            "ARTERY_INFERENCE_PROJECT": PROJECT,
            "ARTERY_INFERENCE_MODEL": MODEL,
            "ARTERY_INFERENCE_BASE_MODEL": TINY,
            "ARTERY_INFERENCE_REPLICA_ID": name,
            "ARTERY_INFERENCE_HEARTBEAT_S": "1",
            **env,
        },
    )


@pytest.fixture
async def replicas(stack, js):
    names = ["replica-a", "replica-b"]
    for name in names:
        start_replica(stack, name)
    for name in names:
        await asyncio.to_thread(stack.processes[name].wait_ready, 120)

    async def both_live():
        return len(await live_replicas(js, PROJECT, MODEL)) == 2

    await wait_for(both_live, timeout=30)
    infos = sorted(await live_replicas(js, PROJECT, MODEL), key=lambda r: r.replica_id)
    return [openai.AsyncOpenAI(base_url=f"{info.url}/v1", api_key="none") for info in infos]


async def complete(client: openai.AsyncOpenAI, model: str = MODEL, **kw) -> str:
    response = await client.chat.completions.create(
        model=model, messages=PROMPT, max_tokens=8, temperature=0, **kw
    )
    return response.choices[0].message.content


async def test_two_replicas_pause_and_requests_during_the_pause_complete_after_resume(replicas, nc):
    outcome = await pause_replicas(nc, PROJECT, MODEL, lease_seconds=60, requested_by="test", timeout_s=20)
    assert sorted(outcome.acked) == ["replica-a", "replica-b"] and not outcome.missing
    started = time.monotonic()
    pending = [asyncio.create_task(complete(client)) for client in replicas for _ in range(3)]
    await asyncio.sleep(1.0)
    assert not any(task.done() for task in pending), "requests must wait while paused"
    resumed = await resume_replicas(nc, PROJECT, MODEL, outcome.lease_id, requested_by="test")
    assert sorted(resumed.acked) == ["replica-a", "replica-b"]
    results = await asyncio.gather(*pending)
    assert len(results) == 6 and all(isinstance(r, str) for r in results)
    assert time.monotonic() - started >= 1.0


async def test_a_lease_that_is_not_renewed_resumes_inference_by_itself(replicas, nc):
    outcome = await pause_replicas(nc, PROJECT, MODEL, lease_seconds=2, requested_by="dead-trainer")
    assert len(outcome.acked) == 2
    started = time.monotonic()
    # Nobody resumes: the requests complete once the lease runs out.
    results = await asyncio.gather(*(complete(client) for client in replicas))
    waited = time.monotonic() - started
    assert all(isinstance(r, str) for r in results)
    assert 1.0 <= waited < 15, waited


def make_adapter(path) -> None:
    """A LoRA (lm_head included) with large random weights: it must change greedy output."""
    base = AutoModelForCausalLM.from_pretrained(resolve_base_model(TINY))
    peft_model = get_peft_model(
        base,
        LoraConfig(
            r=4, lora_alpha=32, target_modules=["q_proj", "v_proj", "lm_head"], init_lora_weights=False
        ),
    )
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.normal_(0, 2.0, generator=torch.Generator().manual_seed(len(name)))
    peft_model.save_pretrained(path, safe_serialization=True)


async def test_a_published_adapter_changes_the_output_and_is_served_under_its_step(replicas, js, tmp_path):
    client = replicas[0]
    before = await complete(client)
    make_adapter(tmp_path / "adapter")
    data = pack_adapter(tmp_path / "adapter")
    await put_adapter(js, "inf/agent/0001", data)
    published_at = time.monotonic()
    await publish_event(
        js,
        subjects.checkpoint("published", PROJECT, MODEL),
        CheckpointPublished(
            id=new_event_id(),
            project=PROJECT,
            model=MODEL,
            step=1,
            object_name="inf/agent/0001",
            sha256=sha256_hex(data),
            size_bytes=len(data),
            base_model=TINY,
            served_name=f"{MODEL}@1",
        ),
    )

    async def served():
        models = await client.models.list()
        return f"{MODEL}@1" in {m.id for m in models.data}

    await wait_for(served, timeout=60)
    assert time.monotonic() - published_at < 60
    after = await complete(client)
    assert after != before
    assert await complete(client, model=f"{MODEL}@1") == after
    assert await complete(client, model=f"{MODEL}@0") == before
    response = await client.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=4, temperature=0)
    assert response.model == f"{MODEL}@1"
    with pytest.raises(openai.NotFoundError):
        await complete(client, model=f"{MODEL}@7")
