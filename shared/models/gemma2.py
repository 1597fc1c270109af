"""Gemma 2: Llama's parts, arranged differently.
- RMSNorm scales by (1 + w), not w: the checkpoint's w is loaded as 1 + w, so the norm layer (and
  part 15's fused kernel for it) stays Llama's.
- Four norms a layer: the attention's and the MLP's outputs are normalised too before each joins
  the residual ("sandwich" norms).
- The embeddings are scaled by sqrt(hidden size); the MLP is GeGLU (gelu, tanh approximation).
- Attention: every other layer slides over a window (4096 tokens), scores are scaled by
  query_pre_attn_scalar^-1/2 and soft-capped (50 * tanh(s / 50)): the attention backend does all
  three, per layer (part 15).
- The logits are soft-capped too (30 * tanh(logits / 30)). The head is the embedding (tied).

In vLLM: vllm/model_executor/models/gemma2.py, GemmaRMSNorm in
vllm/model_executor/layers/layernorm.py."""
from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..layers import RMSNorm, set_weight_attrs
from ..model import LayerFactory, LlamaDecoderLayer, LlamaForCausalLM


def _load_one_plus(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
    param.data.copy_(loaded.float() + 1)  # (1 + w) in fp32, as Gemma computes it, then the model's dtype


class Gemma2DecoderLayer(LlamaDecoderLayer):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary, layers: LayerFactory, prefix: str):
        super().__init__(cfg, layer_idx, rotary, layers, prefix)
        self.pre_feedforward_layernorm = layers.rms_norm(cfg)
        self.post_feedforward_layernorm = layers.rms_norm(cfg)

    def forward(self, positions, x, residual):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(positions, x))
        x, residual = self.pre_feedforward_layernorm(x, residual)  # adds the attention's output first
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Gemma2ForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = Gemma2DecoderLayer

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None, layers: LayerFactory | None = None):
        super().__init__(cfg, max_positions, layers)
        for module in self.modules():
            if isinstance(module, RMSNorm):
                set_weight_attrs(module.weight, {"weight_loader": _load_one_plus})

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # sqrt(hidden) rounded to the model's dtype first, as Gemma does.
        return x * torch.tensor(self.config.hidden_size ** 0.5, dtype=x.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap
