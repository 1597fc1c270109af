"""The runner seam: the one place a step's inputs meet the model's forward.

Why. A decode step makes the same few hundred kernel calls whatever its batch: per layer two norms,
four projections, the rotary embedding, attention and SiLU, each reached through nn.Module calls
and Python. On a GPU that Python, not the arithmetic, is most of a small step. The cure is to lay a
step's calls down once and replay them: vLLM captures CUDA graphs for a set of batch sizes at
start-up and replays the one that fits, its inputs copied into the graph's fixed buffers and the
batch padded up to the captured size.

How. The model runner calls `GraphRunner` with the step's input ids, positions and attention
metadata (`__call__`). A runner `capture`s at start-up, and at each step `padded_size` says
whether the step can be replayed, at which captured size; `replay` runs it. This base class
captures nothing: every step runs the modules' forward, `model(input_ids, positions)`, with the
attention backend and its metadata in the forward context. A subclass changes only how a captured
step runs:
- on a CPU, cpu/graph_runner.py's `CpuGraphRunner` binds every layer's weights to the part's C
  kernels once and replays any step as one loop of kernel calls (cpu/README.md);
- on a GPU, a CUDA-graph runner captures the forward at each capture size and replays the graph.
The forward's result is the same either way, bit for bit on the CPU (tests/test_part15_graph_runner.py).

In vLLM v0.33.0: vllm/compilation/cuda_graph.py (CUDAGraphWrapper: a captured graph per batch
descriptor, replayed on a match), vllm/v1/cudagraph_dispatcher.py (which captured size a batch
uses) and vllm/v1/worker/gpu_model_runner.py (capture_model at start-up, the padded batch)."""
from __future__ import annotations

import torch

from shared.forward_context import set_forward_context

from .paged_attention import PagedAttention, resolve_obj_by_qualname


class GraphRunner:
    """Eager: no capture, every step through the modules."""

    def __init__(self, model: torch.nn.Module, attn: PagedAttention):
        self.model, self.attn = model, attn

    def capture(self) -> None:
        """Make the step shapes this runner replays ready (at start-up, before the first step)."""

    def padded_size(self, num_tokens: int, metadata) -> int | None:
        """The captured size a step of `num_tokens` replays at (>= num_tokens: the rest is padding,
        whose slots are -1), or None: the step runs the modules' forward."""
        return None

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata, size: int) -> torch.Tensor:
        """The hidden states of a step that padded_size accepted."""
        raise NotImplementedError

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata) -> torch.Tensor:
        with set_forward_context(self.attn, metadata):
            size = self.padded_size(input_ids.shape[0], metadata)
            if size is not None:
                return self.replay(input_ids, positions, metadata, size)
            return self.model(input_ids, positions)


# The CPU's runner, by its qualified name: the stage imports the CPU appendix only on a CPU.
CPU_GRAPH_RUNNER = "part15_full.cpu.graph_runner.CpuGraphRunner"


def make_graph_runner(model: torch.nn.Module, attn: PagedAttention, device: torch.device) -> GraphRunner:
    """The runner for this device, captured: on a CPU the C-kernel one where it applies, else eager."""
    runner = None
    if device.type == "cpu":
        runner = resolve_obj_by_qualname(CPU_GRAPH_RUNNER).build(model, attn)
    runner = runner or GraphRunner(model, attn)
    runner.capture()
    return runner
