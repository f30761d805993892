"""``art.dev``: ART's advanced settings, mapped onto Artery's where Artery has the knob.

ART takes these as ``TypedDict``s (``art.dev.InitArgs(max_seq_length=8192)`` is a plain dict), so
do we; every name ART's ``art.dev`` exports exists here. The TypedDicts list the keys Artery reads;
any other key is accepted as ART accepts it.

Two kinds of setting, treated differently:

- ``TrainConfig`` keys (``art.dev.TrainConfig``, ``backend.train`` keywords) change the step's
  math: each is translated into the wire ``TrainConfig`` or, when Artery's trainer computes
  something else, refused by name (``UnsupportedSetting``), so a script never trains on math it
  did not ask for.
- ``InternalModelConfig`` keys tune ART's in-process engines (Unsloth, vLLM, Tinker). Where Artery
  has the same knob it is mapped (``model_settings``): the LoRA shape, the longest training
  sequence, the LoRA rank a vLLM replica serves, chat-template variables. The rest has no effect
  here (Artery's services are configured by their own ``ARTERY_*`` settings) and is said so once
  per process, in a warning naming the key; none of them is an error.
"""

from __future__ import annotations

from typing import Any, Literal, TypedDict

from artery.utils.art_settings import (
    ModelSettings,
    UnsupportedSetting,
    lora_fields,
    model_config_fields,
    model_settings,
    note_no_effect,
    train_config_fields,
)


class LoRAConfig(TypedDict, total=False):
    """The adapter's shape (ART main's ``LoRAConfig``); the trainer's defaults fill what is unset."""

    rank: int
    alpha: float
    dropout: float
    target_modules: list[str]
    init_weights: bool


class PeftArgs(TypedDict, total=False):
    """ART 0.3-0.5's ``peft_args`` (PEFT ``LoraConfig`` names); ``r``, ``lora_alpha``,
    ``lora_dropout`` and ``target_modules`` shape the adapter, as ``LoRAConfig``'s keys."""

    r: int
    lora_alpha: float
    lora_dropout: float
    target_modules: list[str]
    bias: str
    use_rslora: bool
    random_state: int
    use_gradient_checkpointing: str | bool


class InitArgs(TypedDict, total=False):
    """Unsloth's ``FastLanguageModel.from_pretrained`` arguments in ART. ``max_seq_length`` is
    the trainer's longest sequence (``ARTERY_TRAINER_MAX_SEQ_LEN``); ``max_lora_rank`` the largest
    rank a vLLM replica serves; the others tune Unsloth and have no effect here."""

    model_name: str
    max_seq_length: int
    dtype: str | None
    load_in_4bit: bool
    load_in_8bit: bool
    fast_inference: bool
    gpu_memory_utilization: float
    max_lora_rank: int
    enable_prefix_caching: bool


class EngineArgs(TypedDict, total=False):
    """vLLM's ``AsyncEngineArgs`` in ART. ``max_lora_rank`` and ``dtype`` reach Artery's replica
    (``ARTERY_INFERENCE_MAX_LORA_RANK``, ``ARTERY_INFERENCE_DTYPE``); the rest has no effect here."""

    model: str
    served_model_name: str
    dtype: str
    max_model_len: int | None
    gpu_memory_utilization: float
    enforce_eager: bool | None
    num_scheduler_steps: int
    max_lora_rank: int
    max_loras: int
    enable_sleep_mode: bool
    enable_prefix_caching: bool | None
    tensor_parallel_size: int


class TrainerArgs(TypedDict, total=False):
    """Hugging Face ``TrainingArguments`` in ART; ``max_grad_norm`` becomes the model's default
    for each step (``TrainConfig.max_grad_norm``); the rest has no effect here."""

    learning_rate: float
    max_grad_norm: float
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    optim: str
    gradient_accumulation_steps: int
    per_device_train_batch_size: int


class TinkerTrainingClientArgs(TypedDict, total=False):
    rank: int
    seed: int | None
    train_mlp: bool
    train_attn: bool
    train_unembed: bool


class TinkerArgs(TypedDict, total=False):
    """Thinking Machines' Tinker client in ART (its Tinker backends); no effect here."""

    renderer_name: str
    training_client_args: TinkerTrainingClientArgs


TinkerNativeArgs = TinkerArgs


class VllmRuntimeArgs(TypedDict, total=False):
    mode: Literal["managed", "external"]
    server_url: str
    api_key: str | None


RolloutWeightsMode = Literal["lora", "merged"]
RolloutWeightUpdateMode = Literal["step_lora", "in_flight_lora"]


class InternalModelConfig(TypedDict, total=False):
    """ART's ``art.dev.InternalModelConfig``; see ``model_settings`` for what each key becomes."""

    init_args: InitArgs
    engine_args: EngineArgs
    peft_args: PeftArgs
    tinker_args: TinkerArgs | None
    tinker_native_args: TinkerNativeArgs | None
    trainer_args: TrainerArgs
    trainer_gpu_ids: list[int]
    inference_gpu_ids: list[int]
    rollout_weights_mode: RolloutWeightsMode
    rollout_weight_update_mode: RolloutWeightUpdateMode
    chat_template_kwargs: dict[str, Any]
    chat_template: str
    chat_template_path: str
    chat_template_content_format: str
    chat_template_tool_schema_format: str
    vllm_runtime: VllmRuntimeArgs
    allow_unvalidated_arch: bool


class BackendModelConfig(InternalModelConfig, total=False):
    lora_config: LoRAConfig


class ServerArgs(TypedDict, total=False):
    """vLLM's OpenAI server arguments in ART; Artery's replica has its own (no effect here)."""

    host: str | None
    port: int
    api_key: str | None
    tool_call_parser: str | None
    enable_auto_tool_choice: bool
    return_tokens_as_token_ids: bool


class OpenAIServerConfig(TypedDict, total=False):
    """ART's ``register(_openai_client_config=...)``: ``engine_args`` as in ``InternalModelConfig``."""

    log_file: str
    server_args: ServerArgs
    engine_args: EngineArgs


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


class TrainSFTConfig(TypedDict, total=False):
    """ART's ``art.dev.TrainSFTConfig``: ``train_sft(_config=...)`` accepts none of its keys."""


LossType = Literal["cispo", "ppo"]
#: ART's default completion budget for its own rollouts.
DEFAULT_MAX_COMPLETION_LENGTH = 8192


def get_model_config(
    base_model: str, output_dir: str | None = None, config: InternalModelConfig | None = None
) -> InternalModelConfig:
    """ART's helper: the config with ART's documented defaults under what it sets."""
    given: InternalModelConfig = config or {}
    return InternalModelConfig(
        {
            **given,
            "init_args": {"model_name": base_model, "max_seq_length": 32768, **given.get("init_args", {})},
            "engine_args": {**given.get("engine_args", {})},
            "peft_args": {"r": 8, "lora_alpha": 16, **given.get("peft_args", {})},
            "trainer_args": {"learning_rate": 5e-6, "max_grad_norm": 0.1, **given.get("trainer_args", {})},
        }
    )


def get_openai_server_config(
    model_name: str,
    base_model: str,
    log_file: str | None = None,
    lora_path: str | None = None,
    config: OpenAIServerConfig | None = None,
) -> OpenAIServerConfig:
    """ART's helper: the given server config, with the served model named."""
    given: OpenAIServerConfig = config or {}
    engine_args: EngineArgs = {
        "model": base_model,
        "served_model_name": model_name,
        **given.get("engine_args", {}),
    }
    return OpenAIServerConfig({**given, "engine_args": engine_args})


def is_dedicated_mode(config: InternalModelConfig | None) -> bool:
    """ART's test for separate training and inference GPUs (both id lists set)."""
    return bool(config and config.get("trainer_gpu_ids") and config.get("inference_gpu_ids"))


def is_external_vllm_mode(config: InternalModelConfig | None) -> bool:
    return bool(config and (config.get("vllm_runtime") or {}).get("mode") == "external")


def validate_dedicated_config(config: InternalModelConfig | None) -> None:
    """ART checks its GPU split here; Artery places its services itself, so any split is accepted."""


__all__ = [
    "DEFAULT_MAX_COMPLETION_LENGTH",
    "BackendModelConfig",
    "EngineArgs",
    "InitArgs",
    "InternalModelConfig",
    "LoRAConfig",
    "LossType",
    "ModelSettings",
    "OpenAIServerConfig",
    "PeftArgs",
    "RolloutWeightUpdateMode",
    "RolloutWeightsMode",
    "ServerArgs",
    "TinkerArgs",
    "TinkerNativeArgs",
    "TinkerTrainingClientArgs",
    "TrainConfig",
    "TrainSFTConfig",
    "TrainerArgs",
    "UnsupportedSetting",
    "VllmRuntimeArgs",
    "get_model_config",
    "get_openai_server_config",
    "is_dedicated_mode",
    "is_external_vllm_mode",
    "lora_fields",
    "model_config_fields",
    "model_settings",
    "note_no_effect",
    "train_config_fields",
    "validate_dedicated_config",
]
