"""Qwen3: Llama's decoder with an RMSNorm over each head of q and of k before RoPE (its weight is
head_dim long, shared by the heads), no qkv bias (Qwen2 had one) and an explicit head_dim that
need not be hidden / heads. Qwen3-MoE is this attention with part 11's expert blocks.

In vLLM: vllm/model_executor/models/qwen3.py (Qwen3Attention's q_norm, k_norm)."""
from __future__ import annotations

from ..config import ModelConfig
from ..layers import RMSNorm
from ..model import LayerFactory, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary, layers: LayerFactory, prefix: str):
        super().__init__(cfg, layer_idx, rotary, layers, prefix)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = Qwen3DecoderLayer
