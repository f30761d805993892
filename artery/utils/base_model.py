"""Whether a ``base_model`` can be loaded on this machine, asked before anything is started.

A base model is a local directory (weights, or a PEFT adapter over weights that can be had), one
of Artery's embedded models, or a Hugging Face name already in the local cache: the services
never download (``artery.shared.models``). Asked at ``register()``, a name that is none of these
fails in the caller at once, instead of a replica exiting a minute later with the reason in its log.
"""

from __future__ import annotations

import os
from pathlib import Path

from artery.shared import smollm2
from artery.shared.models import SMOLLM2, TINY, in_hf_cache, warm_start


class BaseModelUnavailable(ValueError):
    """The base model is not on this machine; the message says how to provide one."""


def _hf_cache_dir() -> str:
    try:
        from huggingface_hub import constants

        return str(constants.HF_HUB_CACHE)
    except ImportError:
        return os.path.expanduser("~/.cache/huggingface/hub")


def check_base_model(name: str) -> None:
    """Return if ``name`` can be loaded here; raise ``BaseModelUnavailable`` naming what is missing."""
    path = Path(name).expanduser()
    if path.is_dir():
        adapter = warm_start(path)  # raises for an adapter that can never load
        if adapter is not None:
            check_base_model(adapter.base_model)
        elif not (path / "config.json").is_file():
            raise BaseModelUnavailable(
                f"base model directory {name!r} holds neither a model (config.json) nor a PEFT"
                " adapter (adapter_config.json)"
            )
        return
    if name == TINY or name.lower() in (n.lower() for n in smollm2.NAMES):
        return  # embedded: built or converted on first use, without a network
    if in_hf_cache(name):
        return
    raise BaseModelUnavailable(
        f"base model {name!r} is not on this machine: it is not a local directory, not in the local"
        f" Hugging Face cache ({_hf_cache_dir()}), and not one of Artery's embedded models; Artery's"
        " services never download weights. Provide it as one of: a local directory holding the"
        " model (base_model='/path/to/model'); a Hugging Face name already in the local cache"
        f" (`huggingface-cli download {name}` where the hub can be reached); or an embedded model:"
        f" {SMOLLM2!r} (also 'smollm2'), the default, or {TINY!r} for tests."
    )
