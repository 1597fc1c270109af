"""A contiguous KV cache: one request owns a [layers, capacity, kv_heads, head_dim] buffer for
keys and one for values, sized for its prompt plus its max_tokens up front."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.attention import sdpa
from shared.forward_context import AttentionBackend


@dataclass
class CacheMetadata:
    start: int  # position of the first token of this forward pass


class ContiguousKVCache(AttentionBackend):
    def __init__(self, num_layers: int, capacity: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (num_layers, capacity, num_kv_heads, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.scale = head_dim ** -0.5

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def forward(self, layer_idx, q, k, v, metadata: CacheMetadata):
        start, end = metadata.start, metadata.start + q.shape[0]
        # Store this step's keys and values, then attend over everything cached so far.
        self.k[layer_idx, start:end] = k
        self.v[layer_idx, start:end] = v
        return sdpa(q, self.k[layer_idx, :end], self.v[layer_idx, :end], self.scale, q_start=start)
