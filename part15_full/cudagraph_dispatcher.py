"""Which captured graph a step replays, and at what padded size.

Why. A CUDA graph replays fixed shapes: the one captured for 64 tokens runs 64 tokens, whatever the
step holds. So graphs are captured for a set of sizes at start-up, and a step of 50 tokens replays
the 56-token graph, its last 6 tokens padding that writes nothing. Two kinds of graph exist
(config.py's CUDAGraphMode): a FULL graph has attention inside, so its shapes fix the number of
sequences and the tokens of each, and only a uniform batch fits (every sequence decoding
`uniform_decode_query_len` tokens: 1, or 1 + k with k drafts); a PIECEWISE graph leaves attention
out, so any batch of that many tokens fits.

How. `keys` holds every graph captured, "the one source of truth": FULL keys carry the request
count, PIECEWISE keys only the token count. `dispatch` pads the step's tokens up to the next capture
size, then looks for a FULL graph of that shape, then a PIECEWISE one; past the largest size, or
with no graph of the step's kind, the step runs eagerly (NONE). `capture_descs` lists what to
capture at start-up, each mode's largest first. FULL graphs of mixed batches (mode FULL) would need
an attention backend that replays any batch at fixed shapes; none here does
(paged_attention.AttentionCGSupport), so the model runner lowers that mode before it gets here.

In vLLM v0.33.0: vllm/v1/cudagraph_dispatcher.py (CudagraphDispatcher, spelled CUDAGraphDispatcher here as every CUDA-graph name of the stage: initialize_cudagraph_keys,
dispatch) and vllm/forward_context.py (BatchDescriptor)."""
from __future__ import annotations

import bisect
from typing import NamedTuple

from .config import CUDAGraphMode


class BatchDescriptor(NamedTuple):
    """The shape a graph is captured at: tokens, requests (None: any count, PIECEWISE), uniform."""
    num_tokens: int
    num_reqs: int | None = None
    uniform: bool = False


class CUDAGraphDispatcher:
    def __init__(self, mode: CUDAGraphMode, capture_sizes: list[int], max_num_seqs: int,
                 uniform_decode_query_len: int = 1):
        self.mode, self.sizes = mode, sorted(capture_sizes)
        self.q_len, self.max_num_seqs = uniform_decode_query_len, max_num_seqs
        self.keys: dict[CUDAGraphMode, set[BatchDescriptor]] = {CUDAGraphMode.FULL: set(), CUDAGraphMode.PIECEWISE: set()}
        mixed, decode = mode.mixed_mode(), mode.decode_mode()
        if mixed == CUDAGraphMode.FULL:
            raise ValueError("FULL graphs of mixed batches need an attention backend that supports them")
        for n in self.sizes:
            if mixed == CUDAGraphMode.PIECEWISE:  # graphs for any batch of n tokens
                self.keys[CUDAGraphMode.PIECEWISE].add(BatchDescriptor(n))
            if decode == CUDAGraphMode.FULL and n % self.q_len == 0 \
                    and n // self.q_len <= max_num_seqs:  # graphs of n // q_len decoding sequences
                self.keys[CUDAGraphMode.FULL].add(BatchDescriptor(n, n // self.q_len, True))

    def padded(self, num_tokens: int) -> int | None:
        """The smallest capture size >= num_tokens, or None past the largest."""
        i = bisect.bisect_left(self.sizes, num_tokens)
        return self.sizes[i] if i < len(self.sizes) else None

    def dispatch(self, num_tokens: int, num_reqs: int, max_query_len: int) -> tuple[CUDAGraphMode, BatchDescriptor | None]:
        """(the mode the step runs in, the graph's shape). A batch is uniform when every sequence
        has uniform_decode_query_len new tokens."""
        size = self.padded(num_tokens) if self.mode != CUDAGraphMode.NONE and num_tokens else None
        if size is None:
            return CUDAGraphMode.NONE, None
        uniform = max_query_len == self.q_len and num_tokens == self.q_len * num_reqs
        if uniform:
            exact = BatchDescriptor(size, size // self.q_len, True)
            if exact in self.keys[CUDAGraphMode.FULL]:
                return CUDAGraphMode.FULL, exact
        if BatchDescriptor(size) in self.keys[CUDAGraphMode.PIECEWISE]:
            return CUDAGraphMode.PIECEWISE, BatchDescriptor(size)
        return CUDAGraphMode.NONE, None

    def capture_descs(self) -> list[tuple[CUDAGraphMode, list[BatchDescriptor]]]:
        """What to capture at start-up: PIECEWISE, then FULL, each largest first (the smaller graphs
        then reuse the memory pool the largest one allocated)."""
        return [(mode, sorted(self.keys[mode], key=lambda d: -d.num_tokens))
                for mode in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL) if self.keys[mode]]
