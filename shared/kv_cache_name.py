"""What transformers calls a causal LM's KV cache, in its outputs and keyword arguments.

``cache`` since transformers 5.x; ``past_key_values`` before. 5.x still accepts
``past_key_values`` but warns at every call and removes it in 5.40, so the trainer's shared-prompt
pass and the inference engine's decode both pass the cache under this name.
"""

from __future__ import annotations

from transformers.modeling_outputs import CausalLMOutputWithPast

CACHE = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
