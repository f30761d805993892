"""Several named LoRA adapters on one base model, through one ``PeftModel``.

Only safetensors adapters are accepted: a pickle (``adapter_model.bin``, ``*.pt``...) runs code
when it is loaded, and adapters arrive from other machines. Everything here is synchronous and
must run on the engine's model thread, never while a batch is decoding.

A training loop loads step N+1 and then unloads step N, every step, always with the same LoRA
config. PEFT builds an adapter's layers anew on every load (a few hundred module creations and
initialisations: most of a load's time), so an unloaded adapter is kept as a spare while other
adapters remain, and the next load whose ``adapter_config.json`` is the same, field for field,
copies its weights into the spare's layers instead. The last adapter unloaded still takes every
LoRA layer out, spares included: the base model alone serves as before.

An adapter can also be read ahead under a key (``preload``: the replica does so when the trainer
stages a step) and named later (``serve_preloaded``), so that serving the saved step costs next
to nothing. A preloaded adapter keeps the LoRA layers in, as a served one does.
"""

from __future__ import annotations

import contextlib
import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from artery.services.inference.engine.base import EngineError, UnknownAdapter

PICKLE_SUFFIXES = frozenset({".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt"})
#: Unloaded adapters kept for reuse: two alternate in a training loop (step N+1 loads while step N
#: is still served); a few more cover replicas serving several models of one config.
MAX_SPARES = 4


def check_adapter_dir(path: Path) -> None:
    """Refuse anything but a directory holding ``adapter_config.json`` and safetensors weights."""
    if not path.is_dir():
        raise EngineError(f"adapter directory {path} does not exist")
    pickles = sorted(p.name for p in path.iterdir() if p.suffix.lower() in PICKLE_SUFFIXES)
    if pickles:
        raise EngineError(
            f"adapter {path} holds pickle files {pickles}: only safetensors adapters are loaded"
        )
    for required in ("adapter_config.json", "adapter_model.safetensors"):
        if not (path / required).is_file():
            raise EngineError(f"adapter {path} has no {required}")


class LoraSet:
    """The model to run, with its named adapters; ``model`` is the base model until one is loaded.

    PEFT keeps adapters in ``ModuleDict``s, whose keys cannot hold a ``.``; served names such as
    ``qwen2.5@3`` are therefore mapped to internal names.

    ``warm_start``: a PEFT adapter directory that is the model's step 0 (the model's
    ``base_model`` was an adapter): it is loaded once, never listed or unloaded, and active
    whenever no named adapter is asked for.
    """

    WARM_START = "warm_start"

    def __init__(self, base_model: Any, warm_start: Path | None = None) -> None:
        self.model: Any = base_model
        self._internal: dict[str, str] = {}
        #: Adapters read ahead of serving (``preload``), by key: internal names that serve nothing.
        self._preloaded: dict[str, str] = {}
        # Each internal adapter's config as loaded, and the unloaded ones kept for reuse (oldest first).
        self._configs: dict[str, dict[str, Any]] = {}
        self._spares: list[str] = []
        self._ids = itertools.count()
        self._warm: str | None = None
        if warm_start is not None:
            from peft import PeftModel

            check_adapter_dir(Path(warm_start))
            self.model = PeftModel.from_pretrained(
                self.model, str(warm_start), adapter_name=self.WARM_START, is_trainable=False
            )
            self.model.eval()
            self._warm = self.WARM_START

    def names(self) -> list[str]:
        return list(self._internal)

    def __contains__(self, name: object) -> bool:
        return name in self._internal

    def load(self, name: str, path: Path) -> None:
        """Load (or replace) adapter ``name`` from ``path``. A replaced adapter serves until the new
        one is in: a load that fails leaves it served."""
        self._name(name, self._read_in(path, repr(name)))

    def preload(self, key: str, path: Path) -> None:
        """Read the adapter at ``path`` under ``key``, serving nothing until ``serve_preloaded``
        names it: the read (a spare refilled, else PEFT's layers built) is most of a load."""
        if key in self._preloaded:
            raise EngineError(f"an adapter is already preloaded as {key!r}")
        self._preloaded[key] = self._read_in(path, f"preloaded as {key!r}")

    def serve_preloaded(self, name: str, key: str) -> None:
        """Serve the adapter preloaded as ``key`` under ``name``, as ``load`` would."""
        internal = self._preloaded.pop(key, None)
        if internal is None:
            raise UnknownAdapter(key)
        self._name(name, internal)

    def drop_preloaded(self, key: str) -> None:
        """Forget an adapter preloaded and never served; unknown keys are ignored (a preload
        that failed has nothing to drop)."""
        internal = self._preloaded.pop(key, None)
        if internal is not None:
            self._retire(internal)

    def unload(self, name: str) -> None:
        internal = self._internal.pop(name, None)
        if internal is None:
            raise UnknownAdapter(name)
        self._retire(internal)

    def _name(self, name: str, internal: str) -> None:
        """Serve ``internal`` as ``name``, retiring what served under that name only then: retired
        first, the only adapter would take the LoRA layers and every spare out with it, and the
        new one would build them all again."""
        replaced = self._internal.get(name)
        self._internal[name] = internal
        if replaced is not None:
            self._retire(replaced)

    def _read_in(self, path: Path, what: str) -> str:
        """The adapter at ``path`` in the model, under a new internal name (a spare's, refilled,
        where one has its config); ``what`` names it in errors."""
        from peft import PeftModel

        check_adapter_dir(path)
        config = _read_config(path)
        spare = self._spare_for(config)
        if spare is not None and self._refill(spare, path):
            return spare
        internal = f"adapter_{next(self._ids)}"
        try:
            if isinstance(self.model, PeftModel):
                self.model.load_adapter(str(path), adapter_name=internal, is_trainable=False)
            else:
                self.model = PeftModel.from_pretrained(
                    self.model, str(path), adapter_name=internal, is_trainable=False
                )
        except Exception as exc:
            if isinstance(self.model, PeftModel) and internal in self.model.peft_config:
                with contextlib.suppress(Exception):
                    self._delete(internal)
            raise EngineError(f"cannot load adapter {what} from {path}: {exc}") from exc
        self.model.eval()
        if config is not None:
            self._configs[internal] = config
        return internal

    def _retire(self, internal: str) -> None:
        """An adapter no longer served or preloaded: kept as a spare while others keep the LoRA
        layers in, else taken out with every spare."""
        if (self._internal or self._preloaded) and internal in self._configs:
            self._spares.append(internal)  # other adapters keep the LoRA layers in: kept for reuse
            while len(self._spares) > MAX_SPARES:
                self._delete(self._spares.pop(0))
            return
        if not self._internal and not self._preloaded:  # the last one: the spares go with the layers
            for spare in self._spares:
                self._delete(spare)
            self._spares.clear()
        self._delete(internal)

    def _spare_for(self, config: dict[str, Any] | None) -> str | None:
        """A spare whose config is this one (taken out of the spares), else None."""
        if config is None:
            return None
        for spare in self._spares:
            if self._configs.get(spare) == config:
                self._spares.remove(spare)
                return spare
        return None

    def _refill(self, internal: str, path: Path) -> bool:
        """Copy the adapter at ``path`` into ``internal``'s layers; False (the spare deleted, for a
        load of its own) unless its tensors are exactly those layers' parameters, name for name
        and shape for shape. A copy per tensor: PEFT's own state-dict loading walks the whole
        model and costs ten times as much on a 30-layer model."""
        from safetensors.torch import load_file

        layers = self._layers(internal)
        try:
            weights = load_file(path / "adapter_model.safetensors")
        except Exception:
            weights = None
        if (
            weights is None
            or weights.keys() != layers.keys()
            or any(tensor.shape != layers[key].shape for key, tensor in weights.items())
        ):
            self._delete(internal)
            return False
        import torch

        with torch.no_grad():
            for key, tensor in weights.items():
                layers[key].copy_(tensor)
        return True

    def _layers(self, internal: str) -> dict[str, Any]:
        """``internal``'s parameters under the names PEFT saves them by (the adapter's name left
        out: ``...q_proj.lora_A.adapter_3.weight`` is saved as ``...q_proj.lora_A.weight``)."""
        inner, last = f".{internal}.", f".{internal}"
        layers = {}
        for name, param in self.model.named_parameters():
            if inner in name:
                layers[name.replace(inner, ".")] = param
            elif name.endswith(last):  # a ParameterDict's entry (lora_embedding_A/B)
                layers[name[: -len(last)]] = param
        return layers

    def _delete(self, internal: str) -> None:
        self._configs.pop(internal, None)
        if len(self.model.peft_config) > 1:
            self.model.delete_adapter(internal)
        else:  # the last one: take the LoRA layers out and serve the plain base model again
            self.model = self.model.unload()

    @contextlib.contextmanager
    def active(self, name: str | None) -> Iterator[Any]:
        """The model with adapter ``name`` active, or with every adapter off when ``name`` is None
        (the warm-start adapter on, when there is one)."""
        if name is None and self._warm is not None:
            self.model.set_adapter(self._warm, inference_mode=True)
            yield self.model
            return
        if name is None:
            if hasattr(self.model, "disable_adapter"):
                with self.model.disable_adapter():
                    yield self.model
            else:
                yield self.model
            return
        internal = self._internal.get(name)
        if internal is None:
            raise UnknownAdapter(name)
        self.model.set_adapter(internal, inference_mode=True)
        yield self.model


def _read_config(path: Path) -> dict[str, Any] | None:
    """The adapter's ``adapter_config.json`` as a dict (None when it is not one: PEFT's load then
    says what is wrong with it)."""
    try:
        config = json.loads((path / "adapter_config.json").read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None
