"""torch.compile of the model, with the attention left out of the graph ("piecewise").

A decode step runs the same few dozen small kernels per layer, each launched from Python. Compiling
the model with TorchDynamo + Inductor traces those Python calls once into a graph, fuses the
elementwise work (RMSNorm, the rotary embedding, SiLU x up, the residual adds) into a few generated
kernels (C++/OpenMP on a CPU, Triton on a GPU) and removes the per-op Python overhead.

Attention is the part that does not compile well: paged attention reads block tables and
sequence lengths that change every step, and its plan is data dependent. vLLM therefore splits the
graph at every attention call ("piecewise" compilation: the pieces between attentions compiled,
attention run as an opaque op); we do the same by excluding the attention backend from tracing
(`torch.compiler.disable`), so each layer's graph stops before it and resumes after it. Three
details keep the number of compiled graphs small:
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

Modes (`--compilation-mode`): none (eager), piecewise (the above), full (Dynamo over everything,
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

logger = logging.getLogger(__name__)


def compile_model(model: torch.nn.Module, attention_backend, mode: str) -> None:
    """Compile `model.forward` in place (lazily: the first steps of each shape class compile)."""
    if mode == "none":
        return
    import torch._dynamo.config as dynamo_config

    dynamo_config.allow_unspec_int_on_nn_module = True
    if mode == "piecewise":
        attention_backend.forward = torch.compiler.disable(attention_backend.forward)
    compiled = torch.compile(model.forward, dynamic=True)
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
