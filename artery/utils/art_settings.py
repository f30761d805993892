"""What ART's settings (``artery.dev``) become here.

``TrainConfig`` keys are translated into the wire ``TrainConfig`` or refused by name;
``InternalModelConfig`` keys are mapped where Artery has the knob, otherwise noted once
(``note_no_effect``) and never refused."""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("artery.dev")


class UnsupportedSetting(ValueError):
    """An ART setting Artery does not implement (the message names it and says why)."""


#: The keys of ART's ``InternalModelConfig`` (``artery.dev``): known, so not taken for a typo.
ART_MODEL_KEYS = frozenset(
    {
        "init_args",
        "engine_args",
        "peft_args",
        "lora_config",
        "tinker_args",
        "tinker_native_args",
        "trainer_args",
        "trainer_gpu_ids",
        "inference_gpu_ids",
        "rollout_weights_mode",
        "rollout_weight_update_mode",
        "chat_template_kwargs",
        "chat_template",
        "chat_template_path",
        "chat_template_content_format",
        "chat_template_tool_schema_format",
        "vllm_runtime",
        "allow_unvalidated_arch",
        "megatron_model_initialization",
    }
)


#: ART key -> wire ``TrainConfig`` field, for keys that mean the same thing here.
_SAME_MEANING = {
    "epsilon": "epsilon",
    "epsilon_high": "epsilon_high",
    "kl_penalty_coef": "kl_penalty_coef",
    "scale_rewards": "scale_rewards",
    "truncated_importance_sampling": "truncated_importance_sampling",
    "learning_rate": "learning_rate",
    "loss_fn": "loss_fn",
    "grad_accumulation_sequences": "grad_accumulation_sequences",
    "max_grad_norm": "max_grad_norm",
}

#: Keys whose ART default is also Artery's only behaviour: accepted at that value, refused otherwise.
_ONLY_DEFAULT: dict[str, Any] = {
    "advantage_balance": 0.0,
    "importance_sampling_level": "token",
    "kimi_k2_tau": None,
    "kl_ref_adapter_path": None,
    "mask_prob_ratio": False,
    "max_negative_advantage_importance_sampling_weight": None,
    "num_trajectories_learning_rate_multiplier_power": 0.0,
    "packed_sequence_length": None,
    "plot_tensors": False,
    "precalculate_logprobs": False,
    "scale_learning_rate_by_reward_std_dev": False,
    "allow_training_without_logprobs": False,
    # Both only steer how ART's own trainer spends memory and time; ours chooses for itself.
    "save_checkpoint": True,
    "verbose": False,
}

#: Keys that only tune ART's own implementation (chunk sizes): any value is fine, none changes the math.
_PERFORMANCE_ONLY = {"logprob_calculation_chunk_size"}


def train_config_fields(config: Mapping[str, Any] | None) -> dict[str, Any]:
    """ART's ``dev.TrainConfig`` (or ``backend.train`` keywords) as wire ``TrainConfig`` fields."""
    fields: dict[str, Any] = {}
    for key, value in (config or {}).items():
        if key in _SAME_MEANING:
            fields[_SAME_MEANING[key]] = value
        elif key == "ppo":  # ART: ppo=True is the clipped PPO loss, False its default CISPO
            fields["loss_fn"] = "ppo" if value else "cispo"
        elif key == "normalize_advantages":  # ART's backend.train: False means scale_rewards=False
            if not value:
                fields["scale_rewards"] = False
        elif key in _PERFORMANCE_ONLY:
            continue
        elif key in _ONLY_DEFAULT:
            if value != _ONLY_DEFAULT[key]:
                raise UnsupportedSetting(
                    f"train setting {key}={value!r} is not implemented by Artery's trainer"
                    f" (only {_ONLY_DEFAULT[key]!r}, ART's default, is)"
                )
        else:
            raise UnsupportedSetting(f"unknown or unsupported train setting {key!r}")
    return fields


#: Settings already reported as having no effect: each is said once per process.
_noted: set[str] = set()


def note_no_effect(setting: str, why: str) -> None:
    """Warn, once per process and setting, that an ART setting changes nothing here."""
    if setting in _noted:
        return
    _noted.add(setting)
    log.warning("ART setting %s has no effect on Artery: %s", setting, why)


#: ART's ``peft_args`` (PEFT ``LoraConfig`` names) -> our LoRA keys.
_PEFT_KEYS = {
    "r": "rank",
    "lora_alpha": "alpha",
    "lora_dropout": "dropout",
    "init_lora_weights": "init_weights",
}
_LORA_WHY = "Artery's adapter is a plain PEFT LoRA of the given rank, alpha, dropout and target modules"


def lora_fields(config: Mapping[str, Any] | None, *, origin: str = "lora_config") -> dict[str, Any]:
    """A ``LoRAConfig`` (or PEFT ``peft_args``) as the trainer's ``config["lora"]``, validated.

    Keys that do not shape Artery's adapter (Unsloth's, PEFT's variants) are noted, not refused."""
    out: dict[str, Any] = {}
    for key, value in (config or {}).items():
        name = _PEFT_KEYS.get(key, key)
        if name in ("rank", "alpha", "dropout", "target_modules"):
            out[name] = value
        else:
            note_no_effect(f"{origin}.{key}", _LORA_WHY)
    if "rank" in out and (not isinstance(out["rank"], int) or out["rank"] < 1):
        raise ValueError(f"LoRA rank must be a positive integer, got {out['rank']!r}")
    if "alpha" in out and not (isinstance(out["alpha"], int | float) and out["alpha"] > 0):
        raise ValueError(f"LoRA alpha must be > 0, got {out['alpha']!r}")
    if "dropout" in out and not (isinstance(out["dropout"], int | float) and 0 <= out["dropout"] < 1):
        raise ValueError(f"LoRA dropout must lie in [0, 1), got {out['dropout']!r}")
    if "target_modules" in out:
        modules = out["target_modules"]
        if isinstance(modules, str) or not modules or not all(isinstance(m, str) and m for m in modules):
            raise ValueError(f"LoRA target_modules must be a non-empty list of names, got {modules!r}")
        out["target_modules"] = list(modules)
    return out


@dataclass
class ModelSettings:
    """What an ``InternalModelConfig`` asks of Artery."""

    #: The adapter's shape (``peft_args``), for the registry record; None: not given.
    lora: dict[str, Any] | None = None
    #: Sent with every chat request of ``model.openai_client()``.
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    #: ``ARTERY_TRAINER_*`` settings a ``LocalBackend`` starts its trainer with.
    trainer_env: dict[str, str] = field(default_factory=dict)
    #: ``ARTERY_INFERENCE_*`` settings a ``LocalBackend`` starts the model's replica with.
    inference_env: dict[str, str] = field(default_factory=dict)
    #: Default ``TrainConfig`` fields for the model's steps (a step's own setting wins).
    train_defaults: dict[str, Any] = field(default_factory=dict)


_ENGINE_WHY = (
    "it tunes ART's in-process Unsloth/vLLM; Artery's services take their own ARTERY_TRAINER_* and"
    " ARTERY_INFERENCE_* settings"
)
_DTYPES = {"float32", "bfloat16", "float16"}


def _positive_int(key: str, value: Any, least: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{key} must be an integer >= {least}, got {value!r}")
    return value


def _engine_settings(args: Mapping[str, Any], origin: str, out: ModelSettings) -> None:
    """``init_args`` / ``engine_args``: the knobs Artery's trainer and replica also have."""
    if not isinstance(args, Mapping):
        raise ValueError(f"{origin} must be a mapping, got {type(args).__name__}")
    for key, value in args.items():
        setting = f"{origin}.{key}"
        if key == "max_seq_length" and origin == "init_args":
            length = _positive_int(setting, value, 16)
            out.trainer_env["ARTERY_TRAINER_MAX_SEQ_LEN"] = str(length)
        elif key == "max_lora_rank":
            out.inference_env["ARTERY_INFERENCE_MAX_LORA_RANK"] = str(_positive_int(setting, value))
        elif key == "dtype" and value in _DTYPES:
            out.inference_env["ARTERY_INFERENCE_DTYPE"] = value
        elif key == "model_name" and origin == "init_args":
            note_no_effect(setting, "the model's base_model names the weights")
        else:
            note_no_effect(setting, _ENGINE_WHY)


def model_settings(config: Mapping[str, Any] | None) -> ModelSettings:
    """ART's ``InternalModelConfig`` as what Artery's services take; nothing in it is an error
    except a value that cannot be right (a rank of 0). What has no effect is noted once."""
    out = ModelSettings()
    for key, value in (config or {}).items():
        if key == "peft_args":
            out.lora = lora_fields(value, origin="peft_args")
        elif key == "lora_config":
            out.lora = lora_fields(value)
        elif key in ("init_args", "engine_args"):
            _engine_settings(value or {}, key, out)
        elif key == "trainer_args":
            for name, setting in (value or {}).items():
                if name == "max_grad_norm":
                    if not isinstance(setting, int | float) or setting <= 0:
                        raise ValueError(f"trainer_args.max_grad_norm must be > 0, got {setting!r}")
                    out.train_defaults["max_grad_norm"] = float(setting)
                else:
                    note_no_effect(f"trainer_args.{name}", _ENGINE_WHY)
        elif key == "chat_template_kwargs":
            if not isinstance(value, Mapping):
                raise ValueError("chat_template_kwargs must be a mapping")
            out.chat_template_kwargs = dict(value)
        elif key in ART_MODEL_KEYS:
            note_no_effect(key, _ENGINE_WHY)
        else:
            note_no_effect(key, "it is not a key of ART's InternalModelConfig")
    return out


def model_config_fields(config: Mapping[str, Any] | None) -> dict[str, Any]:
    """The registry ``config`` entries of an ``InternalModelConfig``: ``lora`` (from ``peft_args``)
    and ``chat_template_kwargs``, when given."""
    settings = model_settings(config)
    out: dict[str, Any] = {}
    if settings.lora is not None:
        out["lora"] = settings.lora
    if settings.chat_template_kwargs:
        out["chat_template_kwargs"] = settings.chat_template_kwargs
    return out


def with_server_config(settings: ModelSettings, config: Mapping[str, Any]) -> ModelSettings:
    """``register(_openai_client_config=...)``: its ``engine_args`` as ``InternalModelConfig``'s."""
    extra = model_settings({"engine_args": config.get("engine_args") or {}})
    for key in config:
        if key != "engine_args":
            note_no_effect(f"_openai_client_config.{key}", "Artery's replica serves its own OpenAI API")
    merged = copy.deepcopy(settings)
    merged.inference_env.update(extra.inference_env)
    merged.trainer_env.update(extra.trainer_env)
    return merged
