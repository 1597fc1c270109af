"""torch.compile of the model, with attention one opaque op in its graph (mode "attention_op").

A decode step runs the same few dozen small kernels per layer, each launched from Python. Compiling
the model with TorchDynamo + Inductor traces those Python calls once into a graph, fuses the
elementwise work (RMSNorm, the rotary embedding, SiLU x up, the residual adds) into a few generated
kernels (C++/OpenMP on a CPU, Triton on a GPU) and removes the per-op Python overhead.

Attention is the part that does not compile well: paged attention reads block tables and
sequence lengths that change every step, and its plan is data dependent. vLLM therefore splits the
graph at every attention call (its "piecewise" compilation: the pieces between attentions compiled,
attention run as an opaque op); we keep attention opaque the same way, in one graph: attention reaches the backend through the custom op
`vllm_course::unified_attention` (`_AttentionOp`), which Dynamo keeps as one node it does not look
into, so the whole forward is one graph with no break (excluding the backend from tracing
instead would break the graph at every layer: a few dozen graphs, and Python between them at every
step). Three details keep the number of compiled graphs small:
- `dynamic=True`: the token count varies every step; one graph serves every count (Dynamo still
  specialises counts 0 and 1, so batch-1 decode gets a graph of its own);
- layer indices are plain ints on the modules; `allow_unspec_int_on_nn_module` stops Dynamo from
  compiling one copy per layer index;
- Inductor caches compiled graphs on disk (its FX graph cache, under /tmp/torchinductor_$USER),
  so a restart compiles again only what changed: the first start pays the compile time, the next
  ones mostly load it.

CUDA graphs (capturing a step's kernel launches once and replaying them) are vLLM's other half of
this on a GPU. Their configuration is here, `--compilation-config '{"cudagraph_mode": ...,
"cudagraph_capture_sizes": [...]}'` with vLLM's names and defaults (`CompilationConfig`); capture
and replay are in cuda_graph.py, the split at attention in piecewise.py, the runner in
graph_runner.py.

Modes (`--compilation-mode`): none (eager), attention_op (the above), full (Dynamo over everything,
attention included: it splits the graph wherever tracing fails, which on paged attention means
many small graphs). `--enforce-eager` forces none, and no CUDA graphs.

In vLLM v0.33.0: vllm/config/compilation.py (CompilationConfig: mode NONE, STOCK_TORCH_COMPILE,
DYNAMO_TRACE_ONCE, VLLM_COMPILE; splitting_ops; CUDAGraphMode; cudagraph_capture_sizes),
vllm/config/vllm.py (the default capture sizes), vllm/compilation/backends.py (split_graph at the
attention ops), vllm/compilation/cuda_graph.py (CUDAGraphWrapper)."""
from __future__ import annotations

import logging
import time

import torch

from shared.forward_context import AttentionBackend, get_forward_context, override_forward_context

logger = logging.getLogger(__name__)


def compile_model(model: torch.nn.Module, attention_backend, mode: str) -> None:
    """Compile `model.forward` in place (lazily: the first steps of each shape class compile)."""
    if mode == "none":
        return
    import torch._dynamo.config as dynamo_config

    dynamo_config.allow_unspec_int_on_nn_module = True
    compiled = torch.compile(model.forward, dynamic=True)
    if mode == "attention_op":  # attention as the one opaque op, bound to this step's backend and metadata
        compiled = _through_attention_op(compiled)
    state = {"first": True}

    def forward(*args, **kwargs):
        if not state["first"]:
            return compiled(*args, **kwargs)
        start = time.perf_counter()
        out = compiled(*args, **kwargs)
        state["first"] = False
        logger.info("torch.compile (%s): the first step took %.1f s (compiling)", mode, time.perf_counter() - start)
        model.compile_seconds = time.perf_counter() - start
        return out

    model.forward = forward


@torch.library.custom_op("vllm_course::unified_attention", mutates_args=())
def unified_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int) -> torch.Tensor:
    """The step's attention for one layer (stores k, v in the KV cache, which is not an argument: each
    layer's call reads the one before it, so the compiled graph keeps them in order)."""
    return get_forward_context().attention(layer_idx, q, k, v)


@unified_attention.register_fake
def _(q, k, v, layer_idx):
    return torch.empty_like(q)


class _AttentionOp(AttentionBackend):
    """The backend the compiled model sees: every attention call is one node of the op."""

    def forward(self, layer_idx, q, k, v, metadata):
        return torch.ops.vllm_course.unified_attention(q, k, v, layer_idx)


def _through_attention_op(compiled):
    """The compiled forward run with the op as its backend, the op calling the step's attention (the
    backend and metadata of the forward context, bound once a step)."""

    def forward(*args, **kwargs):
        ctx = get_forward_context()
        with override_forward_context(backend=_ATTENTION_OP, metadata=None,
                                      attention=_bound_step(ctx.backend, ctx.metadata)):
            return compiled(*args, **kwargs)
    return forward


def _bound_step(backend, metadata):
    """(layer_idx, q, k, v) -> out: a paged backend's bind_step, any other backend's forward."""
    if hasattr(backend, "bind_step"):
        return backend.bind_step(metadata)
    return lambda layer_idx, q, k, v: backend.forward(layer_idx, q, k, v, metadata)


_ATTENTION_OP = _AttentionOp()
