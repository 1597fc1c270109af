"""Capture a callable once per batch shape, then replay it.

Why. Capturing records the kernels a call launches, with their arguments and the addresses of
every tensor they read and write, into a CUDA graph; a replay launches all of them in one call,
with none of the Python, the dispatcher or the launch overhead between them. The price is the
rule every graph user lives by: a replay reads and writes exactly the memory the capture did. A
step's inputs must therefore be copied into tensors that outlive the graph (graph_runner.py's
static buffers) before a replay, and anything the host decided at capture (a grid size, a branch,
a Python int) is decided for good.

How. `CUDAGraphWrapper` wraps a callable: the whole forward (a FULL graph) or one piece between
two attention calls (PIECEWISE, piecewise.py). `capture(desc, ...)` records the callable as the graph
of one batch shape; the graph runner's start-up loop calls it for each FULL shape, and runs the
split forward once per PIECEWISE shape with `capturing` set in the forward context, so that each
piece records its graph as the forward reaches it. At a step, the wrapper reads the step's mode and
shape from the forward context (shared/forward_context.py, set by the graph runner): in another mode
it just calls through, so FULL and PIECEWISE wrappers nest; at a captured shape it replays and
returns the tensors the capture returned; a shape never captured is an error. Every graph shares one memory pool, and shapes are captured largest
first, so a smaller graph's temporaries reuse the largest one's memory. A wrapper keeps only weak
references to those outputs (`weak_ref`: a tensor over the same memory that does not keep it
allocated): a step replays the graphs of one size, and reads each output before a graph of another
size replays, so the pool may reuse one size's outputs for another's. Strong references would pin
every piece's output at every size, about 30 layers x 3 tensors x 51 sizes on a 135M model.
`capture_session` runs the start-up capture with one garbage collection and one release of cached
memory before it, instead of the two torch.cuda.graph makes for each of the ~1,600 captures.

`CUDAGraph` is the real thing (a torch.cuda.CUDAGraph in a shared pool). `EagerGraph` is a stand-in with the same contract for machines
without CUDA: "capture" keeps the call and its result, "replay" calls it again and writes the
result into the tensors the capture returned. It runs the graph runner's padding, static buffers
and dispatch on a CPU; a runner that forgot to copy an input into its static buffer replays
stale data on it as on a GPU (tests/test_part15_cuda_graphs.py).

In vLLM v0.33.0: vllm/compilation/cuda_graph.py (CUDAGraphWrapper, CUDAGraphEntry), vllm/utils/torch_utils.py
(weak_ref_tensors), vllm/v1/worker/gpu_model_runner.py (capture_model: gc and empty_cache patched out) and
vllm/forward_context.py (the runtime mode and BatchDescriptor a step publishes)."""
from __future__ import annotations

import ctypes
import gc
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import torch

from shared.forward_context import get_forward_context

from .config import CUDAGraphMode
from .cudagraph_dispatcher import BatchDescriptor


@contextmanager
def capture_session() -> Iterator[None]:
    """The start-up capture: garbage collected and cached memory released once, before it; inside,
    torch.cuda.graph's own gc.collect() and empty_cache() per capture are skipped."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    collect, empty_cache = gc.collect, torch.cuda.empty_cache
    gc.collect, torch.cuda.empty_cache = (lambda generation=2: 0), (lambda: None)
    try:
        yield
    finally:
        gc.collect, torch.cuda.empty_cache = collect, empty_cache


class _CudaArray:
    """Memory described by address alone (the CUDA array interface): a tensor made from it holds this
    object, not the allocation."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 2}


def weak_ref(x: Any) -> Any:
    """Tensors (in tuples and lists too) as tensors over the same memory that do not keep it
    allocated; a tensor that is not contiguous stays as it is."""
    if isinstance(x, (tuple, list)):
        return type(x)(weak_ref(t) for t in x)
    if not isinstance(x, torch.Tensor) or not x.is_contiguous() or x.numel() == 0:
        return x
    nbytes = x.numel() * x.element_size()
    if x.is_cuda:
        raw = torch.as_tensor(_CudaArray(x.data_ptr(), nbytes), device=x.device)
    else:
        raw = torch.from_numpy(np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(x.data_ptr())))
    return raw.view(x.dtype).view(x.shape)


class CUDAGraph:
    """A torch.cuda.CUDAGraph in the pool every graph of the process shares."""
    _pool = None

    def capture(self, fn: Callable[[], Any]) -> Any:
        if CUDAGraph._pool is None:
            CUDAGraph._pool = torch.cuda.graph_pool_handle()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=CUDAGraph._pool):
            return fn()

    def replay(self) -> None:
        self.graph.replay()


class EagerGraph:
    """CUDAGraph's contract without CUDA: a replay recomputes the captured call in place."""

    def capture(self, fn: Callable[[], Any]) -> Any:
        self.fn = fn
        self.output = fn()
        return self.output

    def replay(self) -> None:
        _copy_into(self.output, self.fn())


def _copy_into(dst: Any, src: Any) -> None:
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif isinstance(dst, (tuple, list)):
        for d, s in zip(dst, src):
            _copy_into(d, s)


@dataclass
class _Entry:
    graph: Any
    output: Any


class CUDAGraphWrapper:
    """`runnable`, replayed from a graph per BatchDescriptor when the step's mode is `mode`."""

    def __init__(self, runnable: Callable, mode: CUDAGraphMode, graph_cls: type = CUDAGraph):
        assert mode in (CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE)
        self.runnable, self.mode, self.graph_cls = runnable, mode, graph_cls
        self.entries: dict[BatchDescriptor, _Entry] = {}

    def capture(self, desc: BatchDescriptor, *args) -> Any:
        """Record `runnable(*args)` as the graph of `desc` (at start-up, on the shape's dummy inputs)."""
        graph = self.graph_cls()
        output = graph.capture(lambda: self.runnable(*args))
        self.entries[desc] = _Entry(graph, weak_ref(output))
        return output  # this forward's later pieces read it: strong until they are captured

    def __call__(self, *args):
        ctx = get_forward_context()
        if ctx.cudagraph_runtime_mode != self.mode:  # eager, or the other kind of graph (which may contain this one)
            return self.runnable(*args)
        entry = self.entries.get(ctx.batch_descriptor)
        if entry is None:
            if not ctx.capturing:
                raise RuntimeError(f"no {self.mode.name} graph for {ctx.batch_descriptor}: graphs are captured "
                                   "at start-up only")
            return self.capture(ctx.batch_descriptor, *args)  # a piece of the split forward's capture run
        entry.graph.replay()
        return entry.output
