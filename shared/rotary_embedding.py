"""Rotary position embedding (RoPE) and the scalings that stretch it past the context a model was
trained on, as HF configs name them in `rope_scaling` / `rope_parameters`:

- default: inv_freq[i] = theta^(-2i/d);
- linear: every frequency divided by `factor` (positions squeezed);
- dynamic (NTK): theta raised so the longest position served turns no faster than the trained
  context did. HF recomputes it from each forward's length; a paged cache cannot (a key rotated
  once stays rotated), so the table is built once for the longest position the engine serves: equal
  to HF up to the trained context, vLLM's choice beyond it;
- llama3: low frequencies divided by `factor`, high ones kept, a smooth blend between;
- yarn: the same idea by each frequency's rotations over the trained context, with cos/sin scaled
  by an attention factor (0.1 ln(factor) + 1 unless given);
- longrope (Phi-3): a factor per frequency, `short_factor` for positions inside the trained context
  and `long_factor` beyond, cos/sin scaled by sqrt(1 + ln(factor) / ln(trained context)). HF picks one
  set for a whole forward by its length; the table here picks by position, as vLLM does: equal to HF
  for sequences inside the trained context.

`rotary_dim` < head_dim rotates only each head's first rotary_dim values (partial rotary: Phi-4-mini
0.75); the rest pass through.

In vLLM: vllm/model_executor/layers/rotary_embedding/ (one file per scaling, get_rope in
__init__.py)."""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


def _base_inv_freq(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def rope_inv_freq(dim: int, theta: float, scaling: dict[str, Any] | None,
                  max_position: int | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq [dim / 2], the factor cos and sin are scaled by) for positions up to max_position."""
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return _base_inv_freq(dim, theta), 1.0
    factor = scaling.get("factor")
    if kind == "linear":
        return _base_inv_freq(dim, theta) / factor, 1.0
    if kind == "dynamic":
        trained = scaling["original_max_position_embeddings"]
        longest = max(max_position or trained, trained)
        theta = theta * ((factor * longest / trained) - (factor - 1)) ** (dim / (dim - 2))
        return _base_inv_freq(dim, theta), 1.0
    if kind == "llama3":
        inv_freq = _base_inv_freq(dim, theta)
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        trained = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > trained / low, inv_freq / factor, inv_freq)
        smooth = (trained / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < trained / high) & ~(wavelen > trained / low)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        return _yarn_inv_freq(dim, theta, scaling)
    if kind == "longrope":
        raise ValueError("longrope has two sets of frequencies: use RotaryEmbedding")
    raise ValueError(f"rope scaling {kind!r} is not supported ({', '.join(ROPE_TYPES)})")


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inv_freq(dim: int, theta: float, scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071): a frequency that turns fewer than beta_slow times over the trained
    context is interpolated (divided by factor), one that turns more than beta_fast times is kept,
    a linear ramp over the dimensions between."""
    factor, trained = scaling["factor"], scaling["original_max_position_embeddings"]
    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = _yarn_mscale(factor, m) / _yarn_mscale(factor, m_all) if m and m_all else _yarn_mscale(factor)
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:  # the dimension whose frequency turns `rotations` times
        return dim * math.log(trained / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(fast), dim_of(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
    inv_freq = _base_inv_freq(dim, theta)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp), float(attention)


def rope_tables(dim: int, max_position: int, theta: float,
                scaling: dict[str, Any] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_position, dim], fp32, scaled by the rope type's attention factor."""
    positions = torch.arange(max_position, dtype=torch.float32)[:, None]
    if (scaling or {}).get("rope_type") == "longrope":
        trained = scaling["original_max_position_embeddings"]
        factor = scaling.get("factor") or max_position / trained
        attention = scaling.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(trained))
        base = _base_inv_freq(dim, theta)
        short = base / torch.tensor(scaling["short_factor"], dtype=torch.float32)
        long = base / torch.tensor(scaling["long_factor"], dtype=torch.float32)
        freqs = torch.where(positions < trained, positions * short, positions * long)
    else:
        inv_freq, attention = rope_inv_freq(dim, theta, scaling, max_position)
        freqs = positions * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * attention, emb.sin() * attention


class RotaryEmbedding(nn.Module):
    """Rotary position embedding with a precomputed cos/sin table indexed by position, so a
    flattened batch of tokens at arbitrary positions rotates in one gather. Neox layout: the two
    halves of the rotated part of a head are rotated against each other."""

    def __init__(self, head_dim: int, max_position: int, theta: float,
                 scaling: dict[str, Any] | None = None, rotary_dim: int | None = None):
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim
        cos, sin = rope_tables(self.rotary_dim, max_position, theta, scaling)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, heads, D], k: [T, kv_heads, D]; positions: [T]."""
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        r = self.rotary_dim
        if r == self.head_dim:
            return q * cos + self._rotate_half(q) * sin, k * cos + self._rotate_half(k) * sin
        q_rot, k_rot = q[..., :r], k[..., :r]
        return (torch.cat((q_rot * cos + self._rotate_half(q_rot) * sin, q[..., r:]), dim=-1),
                torch.cat((k_rot * cos + self._rotate_half(k_rot) * sin, k[..., r:]), dim=-1))
