"""Phi-3 (Phi-3.5-mini, Phi-4-mini): Llama's decoder, with
- q, k and v stored as one fused `qkv_proj` tensor and gate and up as one `gate_up_proj`: split at
  load into the slices our merged layers take, so tensor parallelism shards them as Llama's;
- partial rotary (Phi-4-mini rotates 3/4 of each head) and longrope scaling (rotary_embedding.py);
- a sliding window on every layer when the config sets one (Phi-3-mini-4k: 2047).

In vLLM: vllm/model_executor/models/phi3.py (a LlamaForCausalLM whose loader maps the fused names)."""
from __future__ import annotations

from typing import Iterable, Iterator

import torch

from ..model import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        cfg = self.config
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim

        def split() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                fused = ".qkv_proj." in name or ".gate_up_proj." in name
                if fused and not name.endswith(".weight"):
                    raise ValueError(f"{name}: a quantized checkpoint's fused projections are not supported")
                if ".qkv_proj." in name:
                    for part, piece in zip(("q_proj", "k_proj", "v_proj"), tensor.split([q, kv, kv], dim=0)):
                        yield name.replace("qkv_proj", part), piece
                elif ".gate_up_proj." in name:
                    for part, piece in zip(("gate_proj", "up_proj"), tensor.chunk(2, dim=0)):
                        yield name.replace("gate_up_proj", part), piece
                else:
                    yield name, tensor

        return super().load_weights(split())
