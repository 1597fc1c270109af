"""Plain-torch attention maths shared by every backend: scaled dot-product with GQA and a
causal mask that accounts for context already in the cache."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .forward_context import AttentionBackend


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
         q_start: int = 0) -> torch.Tensor:
    """Causal attention of one sequence. q: [Tq, H, D] holds positions q_start..q_start+Tq-1;
    k, v: [Tk, KV, D] hold positions 0..Tk-1 (Tk == q_start + Tq). Returns [Tq, H, D]."""
    tq, tk = q.shape[0], k.shape[0]
    # [1, heads, T, D]: PyTorch's CPU flash kernel only takes 4-D inputs (3-D falls back to the
    # slow unfused maths path).
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    gqa = qh.shape[1] != kh.shape[1]
    if tq == 1 or (q_start == 0 and tq == tk):
        # A lone query sees everything; a fresh prefill is plain causal.
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=tq > 1, scale=scale, enable_gqa=gqa)
    else:
        q_pos = torch.arange(q_start, q_start + tq, device=q.device)
        mask = q_pos[:, None] >= torch.arange(tk, device=q.device)[None, :]
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out[0].transpose(0, 1)


class NoCacheAttention(AttentionBackend):
    """Attention over exactly the tokens of this forward pass, keeping nothing: every decode step
    must then recompute the whole sequence. The baseline the KV cache is measured against."""

    def __init__(self, scale: float):
        self.scale = scale

    def forward(self, layer_idx, q, k, v, metadata=None):
        return sdpa(q, k, v, self.scale)
