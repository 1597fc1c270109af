"""Plain-torch attention maths shared by every backend: scaled dot-product with GQA and a
causal mask that accounts for context already in the cache, optionally limited to a sliding
window and with soft-capped scores (Gemma 2)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .forward_context import AttentionBackend


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
         q_start: int = 0, window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Causal attention of one sequence. q: [Tq, H, D] holds positions q_start..q_start+Tq-1;
    k, v: [Tk, KV, D] hold positions 0..Tk-1 (Tk == q_start + Tq). Returns [Tq, H, D].
    `window`: a query at position i sees only keys j with i - window < j <= i (HF's sliding window);
    `softcap`: scores become softcap * tanh(scores / softcap) before the softmax."""
    tq, tk = q.shape[0], k.shape[0]
    # [1, heads, T, D]: PyTorch's CPU flash kernel only takes 4-D inputs (3-D falls back to the
    # slow unfused maths path).
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    gqa = qh.shape[1] != kh.shape[1]
    windowed = window is not None and window < tk
    if softcap is None and not windowed and (tq == 1 or (q_start == 0 and tq == tk)):
        # A lone query sees everything; a fresh prefill is plain causal.
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=tq > 1, scale=scale, enable_gqa=gqa)
        return out[0].transpose(0, 1)
    q_pos = torch.arange(q_start, q_start + tq, device=q.device)[:, None]
    k_pos = torch.arange(tk, device=q.device)[None, :]
    mask = q_pos >= k_pos
    if windowed:
        mask = mask & (k_pos > q_pos - window)
    if softcap is None:
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=gqa)
    else:
        out = softcapped_attention(qh, kh, vh, mask, scale, softcap)
    return out[0].transpose(0, 1)


def softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                         scale: float, softcap: float) -> torch.Tensor:
    """Attention with tanh-capped scores, which SDPA cannot do: q [..., H, Tq, D], k, v [..., KV, Tk, D],
    mask broadcastable to [..., H, Tq, Tk] (True: the key is seen). Scores and softmax in fp32."""
    if q.shape[-3] != k.shape[-3]:  # GQA: each KV head serves H / KV query heads
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = softcap * torch.tanh(scores / softcap)
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return torch.matmul(probs, v.float()).to(q.dtype)


class NoCacheAttention(AttentionBackend):
    """Attention over exactly the tokens of this forward pass, keeping nothing: every decode step
    must then recompute the whole sequence. The baseline the KV cache is measured against."""

    def __init__(self, scale: float):
        self.scale = scale

    def forward(self, layer_idx, q, k, v, metadata=None):
        return sdpa(q, k, v, self.scale)
