"""SmolLM3: Llama with no position embedding on every fourth layer (NoPE: `no_rope_layers` holds 0
there), which lets those layers attend by content alone over long contexts.

In vLLM: no model file of its own; vllm/model_executor/models/registry.py does not list it among
the text models, and vLLM serves it through its Transformers backend (transformers' own modeling
code)."""
from __future__ import annotations

from ..model import LlamaForCausalLM


class SmolLM3ForCausalLM(LlamaForCausalLM):
    def rotary_for(self, layer_idx, layers, max_positions, rotaries):
        if layer_idx in self.config.no_rope_layers:
            return None
        return super().rotary_for(layer_idx, layers, max_positions, rotaries)
