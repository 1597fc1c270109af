"""SmolLM3: Llama with no position embedding on every fourth layer (NoPE: `no_rope_layers` holds 0
there), which lets those layers attend by content alone over long contexts.

In vLLM: vllm/model_executor/models/smollm3.py... is not a file: vLLM serves SmolLM3 through
llama.py, whose attention skips the rotary embedding where `no_rope_layers` says."""
from __future__ import annotations

from ..model import LlamaForCausalLM


class SmolLM3ForCausalLM(LlamaForCausalLM):
    def rotary_for(self, layer_idx, layers, max_positions, rotaries):
        if layer_idx in self.config.no_rope_layers:
            return None
        return super().rotary_for(layer_idx, layers, max_positions, rotaries)
