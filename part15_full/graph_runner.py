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
- on a GPU, `CUDAGraphRunner` below: a step's inputs are already in the static buffers the graphs
  read (InputBatch's device arrays, input_batch.py), padded up to the largest capture size (KV slots
  -1, sequences of length 0), and the step replays a FULL graph (a uniform decode batch, attention
  inside) or the PIECEWISE graphs around eager attention (any other batch) at the next captured
  size; what the dispatcher cannot fit runs eagerly;
- on a CPU, cpu/graph_runner.py's `CpuGraphRunner` binds every layer's weights to the part's C
  kernels once and replays any step as one loop of kernel calls (cpu/README.md).
The forward's result is the same either way: bit for bit on the CPU (tests/test_part15_graph_runner.py),
the same greedy tokens with graphs on and off (tests/test_part15_cuda_graphs.py, tests/test_gpu.py).

In vLLM v0.33.0: vllm/compilation/cuda_graph.py (CUDAGraphWrapper: a captured graph per batch
descriptor, replayed on a match), vllm/v1/cudagraph_dispatcher.py (which captured size a batch
uses) and vllm/v1/worker/gpu_model_runner.py (capture_model at start-up, the padded batch)."""
from __future__ import annotations

import dataclasses
import logging
import time

import torch

from shared.forward_context import override_forward_context, set_forward_context

from .attention_metadata import PAD_SLOT_ID, PagedAttentionMetadata
from .config import CUDAGraphMode
from .cuda_graph import CUDAGraph, CUDAGraphWrapper, EagerGraph, capture_session
from .cudagraph_dispatcher import BatchDescriptor, CUDAGraphDispatcher
from .paged_attention import AttentionCGSupport, PagedAttention
from .piecewise import trace_split
from .platforms import Platform, current_platform

logger = logging.getLogger(__name__)


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


class CUDAGraphRunner(GraphRunner):
    """Replays steps from CUDA graphs (see the module's docstring). `buffers`: InputBatch's device
    arrays, which every step's inputs are views of (their first elements), padding written past
    them; `graph_cls`: cuda_graph.py's CUDAGraph, or its EagerGraph stand-in without CUDA."""

    def __init__(self, model: torch.nn.Module, attn: PagedAttention, mode: CUDAGraphMode, sizes: list[int],
                 max_num_seqs: int, buffers, max_model_len: int,
                 uniform_decode_query_len: int = 1, graph_cls: type = CUDAGraph):
        super().__init__(model, attn)
        self.mode, self.max_model_len = mode, max_model_len
        self.dispatcher = CUDAGraphDispatcher(mode, sizes, max_num_seqs, uniform_decode_query_len)
        # Longer than the largest size by one: a replay's views are then never their whole buffer,
        # which would get a Dynamo trace of its own.
        assert buffers.input_ids.shape[0] > max(sizes) and buffers.seq_lens.shape[0] > max_num_seqs
        self.input_ids, self.positions, self.slot_mapping = buffers.input_ids, buffers.positions, buffers.slot_mapping
        self.seq_lens, self.query_start_loc = buffers.seq_lens, buffers.query_start_loc
        self.block_tables = buffers.block_tables
        self.full = CUDAGraphWrapper(model, CUDAGraphMode.FULL, graph_cls)  # the whole forward, attention inside
        self.piecewise = trace_split(model, graph_cls) if self.dispatcher.keys[CUDAGraphMode.PIECEWISE] else None
        self.full_metadata: dict[BatchDescriptor, PagedAttentionMetadata] = {}
        self._step: tuple[CUDAGraphMode, BatchDescriptor] | None = None
        self.replays = {CUDAGraphMode.FULL: 0, CUDAGraphMode.PIECEWISE: 0}  # steps run from graphs, by mode

    def _metadata_for(self, desc: BatchDescriptor) -> PagedAttentionMetadata:
        """A FULL graph's metadata: views of the static buffers at its shape. The longest query and
        sequence are fixed at capture (a uniform batch; the model's length)."""
        if desc not in self.full_metadata:
            r = desc.num_reqs
            self.full_metadata[desc] = PagedAttentionMetadata(
                self.slot_mapping[:desc.num_tokens], self.block_tables[:r], self.seq_lens[:r],
                self.query_start_loc[:r + 1], desc.num_tokens // r, self.max_model_len)
        return self.full_metadata[desc]

    @torch.inference_mode()  # as the steps run: Dynamo's trace is then the one the steps replay
    def capture(self) -> None:
        """Every graph the dispatcher can pick, at start-up: each after one eager warm-up run (which
        compiles the Triton kernels and traces the split forward), on dummy inputs whose KV slots
        are all -1 (nothing is written), largest first."""
        start = time.perf_counter()
        on_cuda = self.input_ids.is_cuda
        free = torch.cuda.mem_get_info()[0] if on_cuda else 0
        count = 0
        with capture_session():
            for mode, descs in self.dispatcher.capture_descs():
                for desc in descs:
                    self._dummy_run(mode, desc, capture=False)  # warm-up: kernels compiled, the split traced
                    self._dummy_run(mode, desc, capture=True)
                    count += 1
        memory = "stand-in graphs, on the CPU"
        if on_cuda:
            torch.cuda.synchronize()
            memory = f"{(free - torch.cuda.mem_get_info()[0]) / 2**30:.2f} GiB"
        logger.info("CUDA graphs (%s) captured for %d batch shapes in %.1f s, %s", self.mode.name, count,
                    time.perf_counter() - start, memory)

    def _dummy_run(self, mode: CUDAGraphMode, desc: BatchDescriptor, capture: bool) -> None:
        """One step of shape `desc` on dummy inputs: eager, or recording its graphs (`capture`)."""
        n = desc.num_tokens
        ids, pos = self.input_ids[:n], self.positions[:n]
        ids.zero_()
        pos.zero_()
        self.slot_mapping[:n].fill_(PAD_SLOT_ID)
        if mode == CUDAGraphMode.FULL:
            r, q = desc.num_reqs, n // desc.num_reqs
            self.seq_lens[:r].fill_(q)  # each dummy sequence attends to its own tokens
            self.query_start_loc[:r + 1] = torch.arange(r + 1, dtype=torch.int32) * q
            self.block_tables[:r].zero_()
            with set_forward_context(self.attn, self._metadata_for(desc)):
                self.full.capture(desc, ids, pos) if capture else self.model(ids, pos)
        else:  # each piece records its graph as the split forward reaches it; attention gives zeros
            with set_forward_context(self.attn, None, cudagraph_runtime_mode=mode if capture else None,
                                     batch_descriptor=desc, capturing=capture):
                self.piecewise(ids, pos)

    def padded_size(self, num_tokens: int, metadata) -> int | None:
        mode, desc = self.dispatcher.dispatch(num_tokens, metadata.num_seqs, metadata.max_query_len)
        self._step = (mode, desc) if desc is not None else None
        return None if desc is None else desc.num_tokens

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata, size: int) -> torch.Tensor:
        """The step's inputs are the buffers' first elements, and InputBatch wrote the padding past
        them (KV slots -1; sequences of length 0 with no queries, whose blocks are never read): nothing to copy."""
        mode, desc = self._step
        n = input_ids.shape[0]
        if input_ids.data_ptr() != self.input_ids.data_ptr() or metadata.seq_lens.data_ptr() != self.seq_lens.data_ptr():
            raise RuntimeError("a replayed step's inputs must be views of the graphs' buffers (InputBatch.to_device)")
        ids, pos = self.input_ids[:size], self.positions[:size]
        self.replays[mode] += 1
        if mode == CUDAGraphMode.FULL:
            with override_forward_context(cudagraph_runtime_mode=mode, batch_descriptor=desc):
                out = self.full(ids, pos)
        else:  # attention runs eagerly between the pieces, on the step's metadata
            padded = dataclasses.replace(metadata, slot_mapping=self.slot_mapping[:size], _plan=None)
            with override_forward_context(cudagraph_runtime_mode=mode, batch_descriptor=desc,
                                          attention=self.attn.bind_step(padded)):
                out = self.piecewise(ids, pos)
        return out[:n]


def graph_mode_for(mode: CUDAGraphMode, attention: AttentionCGSupport, *, piecewise_ok: bool = True,
                   moe_on_host: bool = False, tensor_parallel: bool = False, kv_connector: bool = False,
                   pipeline: bool = False) -> tuple[CUDAGraphMode, list[str]]:
    """The mode this model and backend can replay, and the reasons it differs from the one asked for
    (vLLM lowers its modes the same way, by the backends' AttentionCGSupport). `piecewise_ok`: the
    forward is not torch.compiled whole, so it can be traced and split at attention."""
    if mode == CUDAGraphMode.NONE:
        return mode, []
    if pipeline:
        return CUDAGraphMode.NONE, ["a pipeline stage receives and sends its activations between steps' kernels "
                                    "(every stage runs eagerly here)"]
    if moe_on_host:
        return CUDAGraphMode.NONE, ["an MoE layer routes on the host (expert parallelism's all-to-all sizes, "
                                    "or the torch reference's experts)"]
    reasons = []
    no_split = None if piecewise_ok else "the forward is torch.compiled whole, so it is not split at attention"
    if tensor_parallel and no_split is None:
        no_split = "the split forward's trace does not hold tensor parallelism's all-reduce (FULL graphs do)"
    if kv_connector:
        attention = AttentionCGSupport.NEVER
        reasons.append("a KV connector's per-layer hooks run on the host, between a layer's kernels")
    none, piece, full = CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL
    decode, mixed = mode.decode_mode(), mode.mixed_mode()
    if no_split and piece in (decode, mixed):
        decode, mixed = (none if m == piece else m for m in (decode, mixed))
        reasons.append(no_split)
    fallback = piece if no_split is None else none
    limit = ("the attention backend plans on the host, so it cannot run inside a FULL graph"
             if attention == AttentionCGSupport.NEVER else
             "the attention backend runs inside a FULL graph only for uniform batches")
    if mixed == full and attention < AttentionCGSupport.ALWAYS:
        mixed = fallback
        reasons.append(limit)
    if decode == full and attention < AttentionCGSupport.UNIFORM_BATCH:
        decode = fallback
        reasons.append(limit)
    reasons = list(dict.fromkeys(reasons))
    if decode == mixed:
        return decode, reasons
    names = {(full, none): CUDAGraphMode.FULL_DECODE_ONLY, (full, piece): CUDAGraphMode.FULL_AND_PIECEWISE}
    return names.get((decode, mixed), piece if piece in (decode, mixed) else none), reasons


def make_graph_runner(model: torch.nn.Module, attn: PagedAttention, device: torch.device,
                      graphs: dict | None = None, platform: Platform | None = None) -> GraphRunner:
    """The runner for this device, captured: CUDA graphs where `graphs` (CUDAGraphRunner's arguments
    past the model and backend) asks for them, else the platform's own where it applies (on a CPU the
    C-kernel one, cpu/graph_runner.py), else eager."""
    runner = None
    if graphs is not None and graphs["mode"] != CUDAGraphMode.NONE:  # on a CPU: the stand-in (envs.py)
        runner = CUDAGraphRunner(model, attn, **graphs, graph_cls=CUDAGraph if device.type == "cuda" else EagerGraph)
    else:
        runner = (platform or current_platform(device)).graph_runner(model, attn)
    runner = runner or GraphRunner(model, attn)
    runner.capture()
    return runner
