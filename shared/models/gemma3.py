"""Gemma 3 (the text models, Gemma3ForCausalLM): Gemma 2's layer, with
- q and k normalised per head before RoPE, as in Qwen3, by Gemma's (1 + w) RMSNorm;
- five sliding-window layers (512 tokens in the 1B model, 1024 in the larger) to one global layer;
- the sliding layers' RoPE with its own base (10,000, unscaled), the global layers' with 1,000,000
  and, in the 4B and larger models, linear scaling;
- no soft-capping (its configs leave both caps unset).

In vLLM: vllm/model_executor/models/gemma3.py."""
from __future__ import annotations

from ..config import ModelConfig
from ..layers import RMSNorm
from ..model import LayerFactory, LlamaAttention
from .gemma2 import Gemma2DecoderLayer, Gemma2ForCausalLM


class Gemma3Attention(LlamaAttention):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary, layers: LayerFactory, prefix: str):
        super().__init__(cfg, layer_idx, rotary, layers, prefix)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)  # (1 + w): loaded so by Gemma2ForCausalLM
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    attention_cls = Gemma3Attention


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    decoder_layer_cls = Gemma3DecoderLayer

    def rotary_for(self, layer_idx, layers, max_positions, rotaries):
        kind = (self.config.layer_types or ("full_attention",) * (layer_idx + 1))[layer_idx]
        if kind not in rotaries:
            rotaries[kind] = layers.rotary_embedding(self.config, max_positions, layer_type=kind)
        return rotaries[kind]
