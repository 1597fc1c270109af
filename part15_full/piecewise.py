"""The forward split at attention, so everything but attention replays from CUDA graphs.

Why. A FULL graph fixes attention's shapes, so only uniform batches replay it. Attention is the one
op whose work depends on the batch's make-up (each sequence's length, its block table); everything
else in a layer (norms, projections, the rotary embedding, SiLU, the residual adds) works row by
row and only cares how many tokens there are. Cut the forward at every attention call and the
pieces between fit any batch of a captured token count: mixed prefill and decode steps replay them,
with attention run eagerly between the pieces on the step's own metadata.

How. Attention is registered as a custom op, `vllm_course::unified_attention_with_output`, that
writes into an output tensor allocated by the piece before it: a graph's output lives at a fixed
address, so the piece after it reads the right memory at every replay (an op that returned a fresh
tensor would leave the next piece reading a stale one). TorchDynamo traces the model's forward
once, with symbolic token counts, into an FX graph in which each attention call is one node of that
op; `split_at_attention` cuts the graph before and after every such node
(torch.fx's split_module) and wraps each other piece in a CUDAGraphWrapper (cuda_graph.py). The
step's attention reaches the op through the forward context (its `attention`: the backend bound to
the step's metadata), as the model's layers reach the backend. The pieces run as traced, not compiled by Inductor: fusing them is what
vLLM's compilation passes add on top.

In vLLM v0.33.0: vllm/compilation/backends.py (split_graph, VllmBackend),
vllm/compilation/piecewise_backend.py and vllm/model_executor/layers/attention/attention.py (the
Attention layer, whose unified_attention_with_output op the graph is split at)."""
from __future__ import annotations

from typing import Callable

import torch
import torch.fx

from shared.forward_context import AttentionBackend, get_forward_context, override_forward_context

from .config import CUDAGraphMode
from .cuda_graph import CUDAGraphWrapper

@torch.library.custom_op("vllm_course::unified_attention_with_output", mutates_args=("output",))
def unified_attention_with_output(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, output: torch.Tensor,
                                  layer_idx: int) -> None:
    attention = get_forward_context().attention  # the step's (layer_idx, q, k, v, out), from the backend's bind_step
    if attention is None:  # a capture's dummy step: attention's result does not matter there
        output.zero_()
        return
    attention(layer_idx, q, k, v, out=output)  # written in place: no copy


@unified_attention_with_output.register_fake
def _(q, k, v, output, layer_idx) -> None:
    return None


class _SplitPoint(AttentionBackend):
    """The backend the model sees while traced: every attention call becomes one node of the op."""

    def forward(self, layer_idx, q, k, v, metadata):
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        torch.ops.vllm_course.unified_attention_with_output(q, k, v, out, layer_idx)
        return out


SPLIT_POINT = _SplitPoint()
ATTENTION_OPS = {torch.ops.vllm_course.unified_attention_with_output,
                 torch.ops.vllm_course.unified_attention_with_output.default}


def _is_attention(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in ATTENTION_OPS


def split_at_attention(gm: torch.fx.GraphModule, graph_cls: type) -> torch.fx.GraphModule:
    """The traced forward cut before and after every attention node, each other piece wrapped for
    PIECEWISE graphs."""
    from torch.fx.passes.split_module import split_module

    part, where = {}, 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if _is_attention(node):  # a piece of its own, between two others
            part[node], where = where + 1, where + 2
        else:
            part[node] = where
    split = split_module(gm, None, lambda node: part[node], keep_original_order=True)
    for name, piece in list(split.named_children()):
        if not any(_is_attention(n) for n in piece.graph.nodes):
            setattr(split, name, _Piece(piece, graph_cls))
    return split


class _Piece(torch.nn.Module):
    """A piece between two attention calls, replayed from a graph per captured size."""

    def __init__(self, piece: torch.fx.GraphModule, graph_cls: type):
        super().__init__()
        self.piece = piece
        self.wrapper = CUDAGraphWrapper(piece, CUDAGraphMode.PIECEWISE, graph_cls)

    def forward(self, *args):
        return self.wrapper(*args)


def trace_split(model: torch.nn.Module, graph_cls: type) -> Callable:
    """model.forward traced once by Dynamo (token counts symbolic) and split at attention. Call the
    result inside a forward context whose `attention` is the step's (None: zeros, on dummy steps)."""
    import torch._dynamo

    state = {}

    def backend(gm: torch.fx.GraphModule, example_inputs):
        split = split_at_attention(gm, graph_cls)
        state.setdefault("modules", []).append(split)  # one per Dynamo trace (token count 1 gets its own)
        return split

    compiled = torch.compile(model.forward, backend=backend, dynamic=True, fullgraph=True)

    def forward(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        with override_forward_context(backend=SPLIT_POINT, metadata=None):  # the step's mode and attention kept
            return compiled(input_ids, positions)
    forward.state = state
    return forward
