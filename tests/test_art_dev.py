"""``art.dev``, ``art.LoRAConfig`` and ``art.local``: ART's settings mapped onto ours, or refused by name."""

from __future__ import annotations

import json

import httpx
import msgspec
import pytest

import artery as art
from artery.dev import UnsupportedSetting, lora_fields, model_config_fields, train_config_fields
from artery.model import traced_transport
from artery.schemas import LoraSpec, ModelRecord, TrainConfig
from artery.shared import subjects
from artery.shared.models import TINY
from artery.shared.registry import read_record


def test_dev_train_config_keys_become_wire_fields():
    fields = train_config_fields(
        art.dev.TrainConfig(
            epsilon=0.1,
            epsilon_high=0.3,
            kl_penalty_coef=0.05,
            scale_rewards=False,
            truncated_importance_sampling=2.0,
            importance_sampling_level="token",  # the only level we have: accepted at it
            logprob_calculation_chunk_size=512,  # performance only: accepted, changes no math
        )
    )
    assert fields == {
        "epsilon": 0.1,
        "epsilon_high": 0.3,
        "kl_penalty_coef": 0.05,
        "scale_rewards": False,
        "truncated_importance_sampling": 2.0,
    }
    config = msgspec.structs.replace(TrainConfig(), **fields)
    assert config.epsilon == 0.1 and config.scale_rewards is False
    assert train_config_fields({"ppo": True}) == {"loss_fn": "ppo"}
    assert train_config_fields({"ppo": False}) == {"loss_fn": "cispo"}
    assert train_config_fields({"normalize_advantages": False}) == {"scale_rewards": False}


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("importance_sampling_level", "sequence"),
        ("precalculate_logprobs", True),
        ("kimi_k2_tau", 0.5),
        ("advantage_balance", 0.3),
        ("mask_prob_ratio", True),
        ("no_such_key", 1),
    ],
)
def test_dev_train_config_key_we_do_not_implement_is_an_error_naming_it(key, value):
    with pytest.raises(UnsupportedSetting, match=key):
        train_config_fields({key: value})


def test_lora_config_and_peft_args_are_one_shape():
    assert lora_fields(art.LoRAConfig(rank=4, alpha=8, dropout=0.05, target_modules=["q_proj"])) == {
        "rank": 4,
        "alpha": 8,
        "dropout": 0.05,
        "target_modules": ["q_proj"],
    }
    assert lora_fields({"r": 4, "lora_alpha": 8, "bias": "none", "random_state": 3407}) == {
        "rank": 4,
        "alpha": 8,
    }
    assert lora_fields({"r": 4, "use_dora": True}) == {"rank": 4}  # noted once, not refused
    with pytest.raises(ValueError, match="rank"):
        lora_fields({"rank": 0})
    with pytest.raises(ValueError, match="target_modules"):
        lora_fields({"target_modules": "q_proj"})  # a string would be read letter by letter


def test_internal_model_config_maps_or_names_what_it_cannot():
    fields = model_config_fields(
        art.dev.InternalModelConfig(peft_args={"r": 2}, chat_template_kwargs={"enable_thinking": False})
    )
    assert fields == {"lora": {"rank": 2}, "chat_template_kwargs": {"enable_thinking": False}}
    # Knobs of ART's own engines are accepted (noted once, tests/test_art_surface.py), never refused.
    assert model_config_fields({"engine_args": {"gpu_memory_utilization": 0.5}}) == {}
    assert model_config_fields({"rollout_weights_mode": "merged"}) == {}
    # The model validates values at construction: a bad one fails in the script, not in the trainer.
    with pytest.raises(ValueError, match="max_seq_length"):
        art.TrainableModel(
            name="m", project="p", base_model=TINY, _internal_config={"init_args": {"max_seq_length": 0}}
        )
    with pytest.raises(ValueError, match="once"):
        art.TrainableModel(
            name="m",
            project="p",
            base_model=TINY,
            lora_config={"rank": 2},
            _internal_config={"peft_args": {"r": 4}},
        )


def test_local_backend_where_art_keeps_it():
    from artery.local import LocalBackend
    from artery.local.backend import LocalBackend as FromModule

    assert LocalBackend is FromModule is art.LocalBackend


async def test_chat_template_kwargs_go_with_every_chat_request_unless_the_request_sets_them():
    seen: list[dict] = []

    class Recorder(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            seen.append(json.loads(request.content))
            return httpx.Response(200, json={})

    transport = traced_transport(
        Recorder(), body_defaults={"chat_template_kwargs": {"enable_thinking": False}}
    )
    async with httpx.AsyncClient(transport=transport, base_url="http://replica/v1") as client:
        await client.post("/chat/completions", json={"model": "m", "messages": []})
        await client.post(
            "/chat/completions", json={"model": "m", "messages": [], "chat_template_kwargs": {"x": 1}}
        )
    assert seen[0]["chat_template_kwargs"] == {"enable_thinking": False}
    assert seen[1]["chat_template_kwargs"] == {"x": 1}


async def test_register_keeps_the_lora_shape_and_refuses_to_change_it_after_training(nats_server):
    backend = art.Backend(nats_url=nats_server.url, inference_url="http://127.0.0.1:9/v1")
    try:
        model = art.TrainableModel(name="shaped", project="api", base_model=TINY, lora_config={"rank": 4})
        await model.register(backend)
        kv = await (await backend._js()).key_value(subjects.MODELS_BUCKET)
        found = await read_record(kv, "api", "shaped")
        assert found.record.lora == LoraSpec(rank=4)
        # Re-registered without a config (a restarted script): the shape it had is kept.
        await art.TrainableModel(name="shaped", project="api", base_model=TINY).register(backend)
        assert (await read_record(kv, "api", "shaped")).record.lora == LoraSpec(rank=4)
        # Once it has trained, another shape is refused before anything is sent to the trainer.
        trained = msgspec.structs.replace(found.record, step=3)
        await kv.put(subjects.model_key("api", "shaped"), msgspec.json.encode(trained))
        other = art.TrainableModel(name="shaped", project="api", base_model=TINY, lora_config={"rank": 8})
        with pytest.raises(ValueError, match=r"trained 3 steps.*new model name"):
            await other.register(backend)
        assert isinstance((await read_record(kv, "api", "shaped")).record, ModelRecord)
        assert (await read_record(kv, "api", "shaped")).record.lora == LoraSpec(rank=4)
    finally:
        await backend.close()
