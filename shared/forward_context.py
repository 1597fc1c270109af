"""The one object through which the model runner hands per-step metadata to attention layers.

The model never sees KV caches, block tables or sequence lengths: each attention layer asks
`get_forward_context()` for the backend and its metadata, set around a forward pass with
`set_forward_context(...)`. Later parts swap the backend (paged, batched) without touching the
model, the way vLLM's attention layers read `ForwardContext`."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch


class AttentionBackend:
    """Computes attention for one layer: q [T, H, D], k/v [T, KV, D] for the new tokens of this
    step (already rotated); stores k/v wherever the backend keeps its cache; returns [T, H, D]."""

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                metadata: Any) -> torch.Tensor:
        raise NotImplementedError


@dataclass
class ForwardContext:
    backend: AttentionBackend
    metadata: Any = None


_context: ForwardContext | None = None


@contextmanager
def set_forward_context(backend: AttentionBackend, metadata: Any = None) -> Iterator[None]:
    global _context
    previous, _context = _context, ForwardContext(backend, metadata)
    try:
        yield
    finally:
        _context = previous


def get_forward_context() -> ForwardContext:
    if _context is None:
        raise RuntimeError("attention called outside set_forward_context(...)")
    return _context
