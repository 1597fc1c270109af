"""The one object through which the model runner hands per-step metadata to attention layers.

The model never sees KV caches, block tables or sequence lengths: each attention layer asks
`get_forward_context()` for the backend and its metadata, set around a forward pass with
`set_forward_context(...)`. Later parts swap the backend (paged, batched) without touching the
model, the way vLLM's attention layers read `ForwardContext`.

Part 15 keeps the rest of a step's per-forward state here too, as vLLM does: the CUDA-graph mode
and batch shape a step replays (each graph wrapper reads them), whether the start-up capture is
recording graphs, and the step's attention bound to its metadata (which the custom ops that stand
for attention in a traced forward call). One context per step, set by the runner seam.

In vLLM v0.33.0: vllm/forward_context.py (ForwardContext, set_forward_context)."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator

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
    # Part 15: the step's CUDAGraphMode (None: eager) and BatchDescriptor, whether graphs may be
    # recorded (the start-up capture only), and attention as (layer_idx, q, k, v, out=None) -> out.
    cudagraph_runtime_mode: Any = None
    batch_descriptor: Any = None
    capturing: bool = False
    attention: Callable | None = None


_context: ForwardContext | None = None


@contextmanager
def set_forward_context(backend: AttentionBackend, metadata: Any = None, **step: Any) -> Iterator[None]:
    global _context
    previous, _context = _context, ForwardContext(backend, metadata, **step)
    try:
        yield
    finally:
        _context = previous


@contextmanager
def override_forward_context(**changes: Any) -> Iterator[None]:
    """The current context with some fields changed, for a part of the forward (a graph replay, a
    traced forward whose attention is an op)."""
    global _context
    previous = get_forward_context()
    _context = replace(previous, **changes)
    try:
        yield
    finally:
        _context = previous


def get_forward_context() -> ForwardContext:
    if _context is None:
        raise RuntimeError("attention called outside set_forward_context(...)")
    return _context
