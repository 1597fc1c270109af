"""Building blocks of the decoder. The model builds its projections, embedding and head through a
`LayerFactory` (model.py), so tensor-parallel, expert and quantized layers (later parts) can
replace them without touching the model definition."""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
    param.data.copy_(loaded)


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class Linear(nn.Module):
    """y = x W^T + b. The base of every projection; subclasses only change how weights load."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = _param(out_features, in_features)
        self.weight.weight_loader = self.weight_loader
        self.bias = _param(out_features) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        default_weight_loader(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several projections of the same input stacked into one matmul (gate+up, or q+k+v).
    Checkpoints store them apart; `shard_id` says which slice a loaded tensor fills."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False,
                 shard_names: list[Any] | None = None):
        super().__init__(in_features, sum(output_sizes), bias)
        names = shard_names or list(range(len(output_sizes)))
        offsets = [0]
        for size in output_sizes:
            offsets.append(offsets[-1] + size)
        self.shards = {n: (offsets[i], output_sizes[i]) for i, n in enumerate(names)}

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        if shard_id is None:
            return default_weight_loader(param, loaded)
        start, size = self.shards[shard_id]
        default_weight_loader(param.data.narrow(0, start, size), loaded)


class QKVLinear(MergedLinear):
    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False):
        sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        super().__init__(hidden_size, sizes, bias, shard_names=["q", "k", "v"])
        self.output_sizes = sizes
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.weight = _param(vocab_size, hidden_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class LMHead(Linear):
    def __init__(self, hidden_size: int, vocab_size: int):
        super().__init__(hidden_size, vocab_size, bias=False)


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 like the reference; with `residual` it first adds it (fused
    add+norm, as vLLM does) and returns the new residual too."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = _param(hidden_size)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * h.to(dtype)
        return out if residual is None else (out, residual)


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope scaling {kind!r} is not supported (default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """Rotary position embedding with a precomputed cos/sin table indexed by position, so a
    flattened batch of tokens at arbitrary positions rotates in one gather."""

    def __init__(self, head_dim: int, max_position: int, theta: float,
                 scaling: dict[str, Any] | None = None):
        super().__init__()
        self.head_dim = head_dim
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, heads, D], k: [T, kv_heads, D]; positions: [T]."""
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + self._rotate_half(q) * sin, k * cos + self._rotate_half(k) * sin
