"""A policy's adapter as the files PEFT's ``save_pretrained`` writes, made from its parameters.

Every step saves the adapter, and PEFT finds its tensors by walking the whole model's
``state_dict`` each time, though they are the same parameters every step. So the first save goes
through PEFT, and what it wrote teaches the rest: which parameter each saved key holds (found by
storage: PEFT's tensors are views of the parameters), and the config file, which does not change
while the policy lives. From then on the files are built from the parameters directly, and their
bytes are PEFT's. That is checked on the first save: when the files built here differ from PEFT's
in any byte (a PEFT version that saves other keys or other files), every save goes through PEFT.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from torch import Tensor

from artery.services.trainer.tensor_bytes import safetensors_bytes
from artery.shared.logs import get_logger

log = get_logger(__name__)
CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
#: What PEFT writes into the weights file's header.
WEIGHTS_METADATA = {"format": "pt"}

Files = list[tuple[str, bytes]]


class AdapterFiles:
    """``files()``: the adapter's files (name, bytes), sorted by name, as PEFT saves them.

    ``save_with_peft(directory)`` writes them through PEFT; ``peft_state()`` is PEFT's state dict
    of the adapter (the tensors those files hold); ``trainable`` are the adapter's parameters."""

    def __init__(
        self,
        save_with_peft: Callable[[Path], None],
        peft_state: Callable[[], dict[str, Tensor]],
        trainable: Sequence[tuple[str, Tensor]],
    ) -> None:
        self._save_with_peft = save_with_peft
        self._peft_state = peft_state
        self._trainable = trainable
        #: The config's bytes and each saved key's parameter, once learned; None: not yet, or never.
        self._config: bytes | None = None
        self._keys: list[tuple[str, Tensor]] | None = None
        self._peft_only = False

    @property
    def built_here(self) -> bool:
        """Whether saves now skip PEFT (after a first save whose bytes matched)."""
        return self._keys is not None

    def files(self) -> Files:
        if self._keys is not None and self._config is not None:
            return [(CONFIG, self._config), (WEIGHTS, self._weights(self._keys))]
        files = self._through_peft()
        if not self._peft_only:
            self._learn(files)
        return files

    def _through_peft(self) -> Files:
        with tempfile.TemporaryDirectory(prefix="artery-adapter-") as tmp:
            self._save_with_peft(Path(tmp))
            return [(path.name, path.read_bytes()) for path in sorted(Path(tmp).iterdir())]

    def _learn(self, files: Files) -> None:
        """Take the layout from what PEFT wrote, if files built from it are the same bytes."""
        self._peft_only = True  # unless everything below holds
        saved = dict(files)
        if sorted(saved) != [CONFIG, WEIGHTS]:
            log.info("the adapter is saved through PEFT: it writes other files", files=sorted(saved))
            return
        params = {_storage(p): p for _, p in self._trainable}
        keys = []
        for key, tensor in self._peft_state().items():
            param = params.get(_storage(tensor))
            if param is None:
                log.info("the adapter is saved through PEFT: it saves a tensor that is not trained", key=key)
                return
            keys.append((key, param))
        if self._weights(keys) != saved[WEIGHTS]:
            log.info("the adapter is saved through PEFT: its weights file differs from one built here")
            return
        self._config, self._keys, self._peft_only = saved[CONFIG], keys, False

    @staticmethod
    def _weights(keys: list[tuple[str, Tensor]]) -> bytes:
        return safetensors_bytes(dict(keys), WEIGHTS_METADATA)


def _storage(tensor: Tensor) -> tuple[str, int, str, tuple[int, ...], tuple[int, ...]]:
    """Where a tensor's elements are: a view of a parameter over all of it has the same."""
    return (
        str(tensor.device),
        tensor.data_ptr(),
        str(tensor.dtype),
        tuple(tensor.shape),
        tuple(tensor.stride()),
    )
