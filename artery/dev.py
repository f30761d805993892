"""``art.dev``: ART's advanced settings, mapped onto Artery's, or refused by name.

ART takes these as ``TypedDict``s (``art.dev.TrainConfig(epsilon=0.2)`` is a plain dict), so do we.
Each key either has a meaning here and is translated (``TrainConfig`` keys into the wire
``TrainConfig`` the trainer reads; ``peft_args``/``LoRAConfig`` into the adapter's shape, which the
trainer reads from the model's registry record), or raises ``UnsupportedSetting`` naming it. Nothing
is dropped silently: a script that relies on a knob we do not have must hear so at once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, TypedDict


class UnsupportedSetting(ValueError):
    """An ART setting Artery does not implement (the message names it and says why)."""


class LoRAConfig(TypedDict, total=False):
    """The adapter's shape (ART main's ``LoRAConfig``); the trainer's defaults fill what is unset."""

    rank: int
    alpha: float
    dropout: float
    target_modules: list[str]
    init_weights: bool


class TrainConfig(TypedDict, total=False):
    """ART's ``art.dev.TrainConfig`` keys; see ``train_config_fields`` for what each becomes."""

    advantage_balance: float
    allow_training_without_logprobs: bool
    epsilon: float
    epsilon_high: float
    importance_sampling_level: Literal["token", "sequence", "average", "geometric_average"]
    kimi_k2_tau: float | None
    kl_penalty_coef: float
    kl_ref_adapter_path: str | None
    logprob_calculation_chunk_size: int
    mask_prob_ratio: bool
    max_negative_advantage_importance_sampling_weight: float | None
    num_trajectories_learning_rate_multiplier_power: float
    packed_sequence_length: int | None
    plot_tensors: bool
    ppo: bool
    precalculate_logprobs: bool
    scale_learning_rate_by_reward_std_dev: bool
    scale_rewards: bool
    truncated_importance_sampling: float | None


class InternalModelConfig(TypedDict, total=False):
    """ART's ``art.dev.InternalModelConfig`` keys; see ``model_config_fields``."""

    init_args: dict[str, Any]
    engine_args: dict[str, Any]
    peft_args: dict[str, Any]
    tinker_args: dict[str, Any]
    tinker_native_args: dict[str, Any]
    trainer_args: dict[str, Any]
    trainer_gpu_ids: list[int]
    inference_gpu_ids: list[int]
    rollout_weights_mode: Literal["lora", "merged"]
    chat_template_kwargs: dict[str, Any]
    chat_template: str
    chat_template_path: str
    chat_template_content_format: str
    chat_template_tool_schema_format: str
    allow_unvalidated_arch: bool


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


#: ART's ``peft_args`` (PEFT ``LoraConfig`` names) -> our LoRA keys.
_PEFT_KEYS = {"r": "rank", "lora_alpha": "alpha", "lora_dropout": "dropout"}
#: PEFT keys whose values are what our adapter does anyway.
_PEFT_DEFAULTS = {"bias": "none", "task_type": "CAUSAL_LM", "use_rslora": False, "use_dora": False}


def lora_fields(config: Mapping[str, Any] | None) -> dict[str, Any]:
    """A ``LoRAConfig`` (or PEFT ``peft_args``) as the trainer's ``config["lora"]``, validated."""
    out: dict[str, Any] = {}
    for key, value in (config or {}).items():
        name = _PEFT_KEYS.get(key, key)
        if name == "init_weights":
            if value is not True:
                raise UnsupportedSetting(f"LoRA {key}={value!r}: only PEFT's default initialisation is used")
            continue
        if key in _PEFT_DEFAULTS:
            if value != _PEFT_DEFAULTS[key]:
                raise UnsupportedSetting(f"LoRA setting {key}={value!r} is not implemented by Artery")
            continue
        if key in ("random_state", "use_gradient_checkpointing"):  # Unsloth's; no effect on the math
            continue
        if name not in ("rank", "alpha", "dropout", "target_modules"):
            raise UnsupportedSetting(f"unknown or unsupported LoRA setting {key!r}")
        out[name] = value
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


def model_config_fields(config: Mapping[str, Any] | None) -> dict[str, Any]:
    """ART's ``InternalModelConfig`` as registry ``config`` entries the services read.

    ``peft_args`` -> ``lora`` (the trainer's adapter shape); ``chat_template_kwargs`` ->
    ``chat_template_kwargs`` (sent with every request of ``model.openai_client()``, as ART does).
    Engine, Unsloth, trainer and GPU placement keys configure ART's in-process vLLM and Unsloth:
    here those are the inference and trainer services' own settings (``ARTERY_INFERENCE_*``,
    ``ARTERY_TRAINER_*``), so a script that sets them is told where they went.
    """
    out: dict[str, Any] = {}
    for key, value in (config or {}).items():
        if key == "peft_args":
            out["lora"] = lora_fields(value)
        elif key == "chat_template_kwargs":
            if not isinstance(value, Mapping):
                raise ValueError("chat_template_kwargs must be a mapping")
            out["chat_template_kwargs"] = dict(value)
        elif key in ("engine_args", "init_args", "trainer_args", "trainer_gpu_ids", "inference_gpu_ids"):
            raise UnsupportedSetting(
                f"model setting {key!r} configures ART's in-process engine or trainer; in Artery set the"
                " inference service's ARTERY_INFERENCE_* or the trainer's ARTERY_TRAINER_* settings"
                " (see the README, 'Settings')"
            )
        else:
            raise UnsupportedSetting(f"model setting {key!r} is not implemented by Artery")
    return out


__all__ = [
    "InternalModelConfig",
    "LoRAConfig",
    "TrainConfig",
    "UnsupportedSetting",
    "lora_fields",
    "model_config_fields",
    "train_config_fields",
]
