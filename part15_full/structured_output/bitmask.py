"""The token bitmask: allocate it, pack a bool mask into it, apply it to logits.

Layout (xgrammar's, which vLLM uses): int32 [rows, ceil(V / 32)], bit j of word i is token
32 * i + j, a set bit means "allowed". All bits set (-1) means "no constraint". Packing 32 tokens
per word keeps a row at V / 8 bytes (6 KiB for a 49k vocabulary), which matters because the
scheduler builds the rows on the host every step and ships them to the device with the batch.

Applying it is a masked fill: every logit whose bit is clear becomes -inf, so softmax gives it
probability 0 and no sampler (greedy, top-k, top-p) can pick it. `indices` names the rows of
`logits` to constrain (the other rows belong to requests without a constraint); row r of the
bitmask goes with row r of the logits, as in xgrammar's kernel.

In vLLM: vllm/v1/structured_output/utils.py (apply_grammar_bitmask: reorders the scheduler's rows
into batch order, then calls xgrammar's apply_token_bitmask_inplace; on CPU it upcasts to fp32),
vllm/v1/worker/gpu/structured_outputs.py (Model Runner V2's own Triton kernel)."""
from __future__ import annotations

import numpy as np
import torch

# A row of all ones: every token allowed.
FULL_MASK = -1


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_token_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    return torch.full((num_rows, bitmask_width(vocab_size)), FULL_MASK, dtype=torch.int32)


def pack_allowed(allowed: np.ndarray, vocab_size: int) -> np.ndarray:
    """bool [n] (n <= vocab_size; ids past n are disallowed) -> int32 [ceil(vocab_size / 32)]."""
    bits = np.zeros(bitmask_width(vocab_size) * 32, dtype=bool)
    bits[: len(allowed)] = allowed
    # Little bit order puts token 8k at bit 0 of byte k; four bytes read as a little-endian
    # int32 then put token 32i at bit 0 of word i.
    return np.packbits(bits, bitorder="little").view("<i4").astype(np.int32)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [..., W] -> bool [..., vocab_size], True where allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    # Arithmetic shift of a negative word smears the sign bit leftwards, but `& 1` reads only the
    # bit that was shifted down, so signed int32 is fine.
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.flatten(-2)[..., :vocab_size].bool()


def apply_token_bitmask_inplace(logits: torch.Tensor, bitmask: torch.Tensor,
                                indices: list[int] | None = None) -> None:
    """Set to -inf every logit whose bit is clear, in place, on any device and float dtype.

    logits [B, V]; bitmask int32 [R, W] with W * 32 >= V. Without `indices` rows 0..B-1 are
    constrained (R >= B); with it only those rows (each below B and R)."""
    if bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be int32, got {bitmask.dtype}")
    if logits.dim() != 2 or bitmask.dim() != 2:
        raise ValueError("logits and bitmask must both be 2-D")
    num_rows, vocab = logits.shape
    if bitmask.shape[1] * 32 < vocab:
        raise ValueError(f"bitmask covers {bitmask.shape[1] * 32} tokens, logits have {vocab}")
    rows = list(range(num_rows)) if indices is None else list(indices)
    if not rows:
        return
    if min(rows) < 0 or max(rows) >= min(num_rows, bitmask.shape[0]):
        raise ValueError(f"row index out of range: logits have {num_rows} rows, "
                         f"bitmask {bitmask.shape[0]}")
    bitmask = bitmask.to(logits.device, non_blocking=True)
    if indices is None:
        allowed = unpack_bitmask(bitmask[:num_rows], vocab)
        logits.masked_fill_(~allowed, float("-inf"))
        return
    idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
    allowed = unpack_bitmask(bitmask.index_select(0, idx), vocab)
    # Index-put writes the selected rows back into `logits` itself.
    logits[idx] = logits.index_select(0, idx).masked_fill(~allowed, float("-inf"))
