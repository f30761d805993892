"""A model's ``_internal_config`` knobs, handed to the services that have them.

A ``LocalBackend`` starts the trainer and the model's replica itself, so what a model asks of them
(``ARTERY_TRAINER_MAX_SEQ_LEN``, ``ARTERY_INFERENCE_MAX_LORA_RANK``...) goes into their
environment, when they are not running yet. Services already running, or run by someone else
(``artery up``, compose), keep their own settings: each such knob is noted once, with the
setting that would carry it there.
"""

from __future__ import annotations

import os
from typing import Any

from artery.dev import ModelSettings, note_no_effect


def _say_where(env: dict[str, str], why: str) -> None:
    for key, value in env.items():
        note_no_effect(f"{key}={value}", why)


def apply_model_settings(backend: Any, model: Any, settings: ModelSettings) -> None:
    """Put ``settings``' service environment where ``backend`` starts services, or note why not."""
    if getattr(backend, "stack", None) is None:  # not a LocalBackend: services run on their own
        _say_where(
            {**settings.trainer_env, **settings.inference_env},
            "the backend joins services that run on their own; set it in their environment",
        )
        return
    if settings.trainer_env:
        if getattr(backend, "_started", False):
            running = {**os.environ, **backend.stack.extra_env}
            changed = {k: v for k, v in settings.trainer_env.items() if running.get(k) != v}
            _say_where(changed, "this LocalBackend's trainer is already running with its own setting")
        else:
            backend.stack.extra_env.update(settings.trainer_env)
    if settings.inference_env:
        replica = f"inference-{model.project}-{model.name}"
        if replica in backend.stack.processes:
            _say_where(settings.inference_env, "the model's replica is already running")
        else:
            backend.inference_env.update(settings.inference_env)
