"""Paged attention on a CPU, reading K/V blocks in place: a small C kernel, built at first use.

Why. The torch reference of paged_attention.py (TorchAttention) gathers every block a step reads into a contiguous copy
(`index_select`) and lets SDPA read the copy. A decode row does ~2 FLOPs per byte of K/V it reads,
so on a CPU attention costs what it moves through memory, and the gather triples that: read,
write, read again. Part 15's profile on the held-out workload had the gather and SDPA at ~19% of
the time, next to the GEMMs. vLLM's CPU build has C++ kernels for this; torch has none that takes
a block table, and Inductor's code for the same maths, written in torch, was slower than the
gather (measured while choosing).

How. `csrc/paged_attention_cpu.c` (read it: ~350 lines) walks each row's block table and reads each
key and value once, with an online softmax; threads split the rows by the work they do. It takes
query rows of up to SHORT_QUERY tokens per sequence (decode, and speculative decoding's verification
rows), each with its own causal length, and a longer query (prefill) while its sequence is short
(uses_kernel); long fresh prefills stay on the gather + SDPA path, where plain causal attention
suits SDPA (a chunk on a cached context does not: SDPA with a mask is slow).
A prefill's rows go in tiles of a few rows that read each key once for the whole tile
(`csrc/prefill_tiles.h`, ~190 lines); decode rows go one at a time. A sliding-window layer's rows
(the backend's `windows`, one per layer) start their walk at their window's first key, so such a
layer reads at most a window's keys a row; the SDPA path masks the same keys.
Soft-capped scores (Gemma 2's `logit_softcap`) are not in the kernel: with them `create` declines
and TorchAttention serves.
The same library stores the step's new K/V rows in their slots first (store_kv: one call for K
and V, where torch took an index_copy_ each). fp32 or bf16. build.py compiles it once per machine;
kernels.py declares its functions.

`CpuAttention` is the backend paged_attention.get_attention_backend picks on a CPU when the kernel
is built and the model's shapes fit it; otherwise TorchAttention serves (the engine's results are
the same, to float rounding). A step's plan (which rows go where) is worked out once, by
`bind_step`, and every layer uses it; the CPU graph runner calls the step with the fused QKV
projection's output (`CpuAttentionStep.fused`), the modules with q, k and v.

Off-switches (envs.py): VLLM_COURSE_CPU_ATTENTION=0 (the torch reference),
VLLM_COURSE_CPU_ATTENTION_TILES=0 (prefills row by row, as decode), VLLM_COURSE_CPU_ATTENTION_AMX=0.

In vLLM v0.33.0: vllm/v1/attention/backends/cpu_attn.py (CPUAttentionBackendImpl, calling
ops.cpu_attn_reshape_and_cache and ops.cpu_attention_with_kv_cache), csrc/cpu/cpu_attn.cpp and
csrc/cpu/cpu_attn_impl.hpp (the kernels, one per ISA)."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import lru_cache
from types import SimpleNamespace

import torch

from shared.attention import sdpa

from . import envs
from ..attention_metadata import PagedAttentionMetadata
from ..block_utils import cdiv
from ..paged_attention import PagedAttention, gather_blocks, reshape_and_cache_ref
from .kernels import load

logger = logging.getLogger(__name__)

SHORT_QUERY = 8  # queries of up to this many tokens always go through the kernel
# A longer query (a prefill) goes through it too while its sequence is at most this long, and
# always when it is a chunk on a cached context. A fresh prefill is plain causal attention, which
# SDPA takes as matrices; on long ones that beats the kernel's tiles of rows (on a Cascade Lake
# Xeon, 30 layers, fp32: the tiles 564 against 636 ms at 1024 tokens, 2125 against 2041 at 2001; the
# bf16 limit was measured on a Zen 4 EPYC with native bf16, before the tiles). A chunk on a context
# needs SDPA with a mask, which falls to its slow unfused path: a 977-token chunk on 1024 cached took
# 4061 ms there against 1540 in the kernel (fp32; bf16 1841 against 1686).
PREFILL_MAX_LEN = {torch.float32: 1024, torch.bfloat16: 256}


def load_kernel() -> SimpleNamespace | None:
    """The kernel's library, or None (off, no compiler, build failed): then the torch reference."""
    if not envs.VLLM_COURSE_CPU_ATTENTION:
        return None
    return _load_kernel(envs.VLLM_COURSE_CPU_ATTENTION_AMX and torch.cpu._is_amx_tile_supported())


@lru_cache(maxsize=None)
def _load_kernel(amx: bool) -> SimpleNamespace | None:
    lib = load("paged_attention_cpu.c")
    if lib is not None:
        lib.attention_use_amx(int(amx))
    return lib


def fits(heads: int, kv_heads: int, head_dim: int, block_size: int) -> bool:
    """Within the kernel's fixed buffers: up to 16 query heads per KV head, head size and block size
    up to 256."""
    return heads % kv_heads == 0 and heads // kv_heads <= 16 and head_dim <= 256 and block_size <= 256


@dataclass
class _Plan:
    """The rows of one step as the kernel takes them, worked out on the first layer."""
    tables: torch.Tensor  # the block tables, int32, contiguous
    row_idx: torch.Tensor  # [R] int32: the q/out row of each token the kernel attends
    row_seq: torch.Tensor  # [R] int32: its sequence
    row_len: torch.Tensor  # [R] int32: the keys it sees (causal)
    tiles: torch.Tensor  # [N + 1] int32: tile t is rows tiles[t] .. tiles[t + 1] - 1 of the R
    tiled: torch.Tensor  # [N] uint8: 1 where tile t is a prefill's (prefill_tiles.h), 0 for one row
    long: list[tuple[int, int, int, torch.Tensor]]  # long prefills, via SDPA: (first row, q_len, seq_len, blocks)
    slots: torch.Tensor  # the slot mapping, int64, contiguous (-1: a padding token)


def uses_kernel(q_len: int, seq_len: int, dtype: torch.dtype) -> bool:
    """Whether a sequence's query rows of a step go through the kernel (else gather + SDPA)."""
    return q_len <= SHORT_QUERY or q_len < seq_len or seq_len <= PREFILL_MAX_LEN.get(dtype, 0)


def _plan(metadata: PagedAttentionMetadata, block_size: int, dtype: torch.dtype, tile_rows: int,
          short_run: int) -> _Plan:
    """tile_rows: the rows a prefill tile holds; a sequence with more than short_run rows in the
    step goes in such tiles, any other row alone (the row kernel's)."""
    starts = metadata.query_start_loc.tolist()
    seq_lens = metadata.seq_lens.tolist()
    rows, seqs, lens, tiles, tiled, long = [], [], [], [], [], []
    for i, (start, end, seq_len) in enumerate(zip(starts, starts[1:], seq_lens)):
        q_len = end - start
        if not uses_kernel(q_len, seq_len, dtype):
            long.append((start, q_len, seq_len, metadata.block_tables[i, :cdiv(seq_len, block_size)].long()))
            continue
        context = seq_len - q_len  # tokens cached before this step's
        tile = tile_rows if q_len > short_run else 1
        tiles += range(len(rows), len(rows) + q_len, tile)
        tiled += [q_len > short_run] * cdiv(q_len, tile)
        rows += range(start, end)
        seqs += [i] * q_len
        lens += range(context + 1, seq_len + 1)

    def i32(values):
        return torch.tensor(values, dtype=torch.int32)
    tables = metadata.block_tables.to(torch.int32)  # rows may be strided (input_batch.py): the kernel takes the stride
    return _Plan(tables if tables.stride(-1) == 1 else tables.contiguous(), i32(rows), i32(seqs), i32(lens),
                 i32(tiles + [len(rows)]), torch.tensor(tiled, dtype=torch.uint8), long,
                 metadata.slot_mapping.to(torch.int64).contiguous())


class CpuAttention(PagedAttention):
    """The paged KV pool with attention in the C kernel (fp32 or bf16 on the CPU)."""

    def __init__(self, *args, lib: SimpleNamespace, num_heads: int, **kwargs):
        super().__init__(*args, **kwargs)
        if self.logit_softcap is not None:
            raise ValueError("the CPU kernel has no soft-capped scores (create() returns None for them)")
        self.lib, self.num_heads = lib, num_heads
        # A sequence with more query rows than this in a step is tiled (csrc/prefill_tiles.h).
        self.short_run = SHORT_QUERY if envs.VLLM_COURSE_CPU_ATTENTION_TILES else 2 ** 31 - 1
        self.lanes = lib.attention_tile_lanes()  # a tile of G query heads per KV head holds lanes // G rows
        self._step: tuple[PagedAttentionMetadata, CpuAttentionStep] | None = None

    @staticmethod
    def supports(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> bool:
        return dtype in (torch.float32, torch.bfloat16) and fits(num_heads, num_kv_heads, head_dim, block_size)

    @classmethod
    def create(cls, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
               dtype: torch.dtype, device: torch.device, *, num_heads: int, scale: float | None = None,
               sliding_windows: tuple[int | None, ...] | None = None,
               logit_softcap: float | None = None) -> CpuAttention | None:
        """The backend, or None where the kernel is not built, the model's shapes do not fit it or its
        scores are soft-capped (the kernel has no cap)."""
        if logit_softcap is not None:
            logger.info("CPU paged attention: the C kernel has no logit soft-capping (logit_softcap=%s), "
                        "the torch reference serves", logit_softcap)
            return None
        lib = load_kernel()
        if lib is None or not cls.supports(num_heads, num_kv_heads, head_dim, block_size, dtype):
            return None
        return cls(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device, lib=lib,
                   num_heads=num_heads, scale=scale, sliding_windows=sliding_windows)

    def plan(self, metadata: PagedAttentionMetadata) -> _Plan:
        """The step's rows as the kernel takes them (`bind_step` makes it once for every layer)."""
        tile_rows = max(1, self.lanes // (self.num_heads // self.k_cache.shape[3]))
        return _plan(metadata, self.block_size, self.k_cache.dtype, tile_rows, self.short_run)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               metadata: PagedAttentionMetadata, out: torch.Tensor | None = None) -> torch.Tensor:
        return self._cpu_step(metadata)(layer_idx, q, k, v, out)

    def bind_step(self, metadata: PagedAttentionMetadata):
        if self.kv_connector is not None:  # the connector's per-layer hooks around attend: the base's step
            return super().bind_step(metadata)
        return self._cpu_step(metadata)

    def _cpu_step(self, metadata: PagedAttentionMetadata) -> CpuAttentionStep:
        if self._step is None or self._step[0] is not metadata:
            self._step = (metadata, CpuAttentionStep(self, metadata))
        return self._step[1]


class CpuAttentionStep:
    """One step's attention for every layer: the plan and the kernels' fixed arguments worked out
    once. Called as a backend step, (layer_idx, q, k, v) -> out; `fused` takes the fused QKV
    projection's output instead (the graph runner's call)."""

    def __init__(self, backend: CpuAttention, metadata: PagedAttentionMetadata):
        self.backend, self.metadata = backend, metadata
        self.plan = plan = backend.plan(metadata)
        k_cache = backend.k_cache
        self.caches = [(k_cache[i].data_ptr(), backend.v_cache[i].data_ptr()) for i in range(k_cache.shape[0])]
        self.num_slots = k_cache.shape[1] * k_cache.shape[2]
        self.bf16 = int(k_cache.dtype == torch.bfloat16)
        self.kv_heads, self.d = k_cache.shape[3], k_cache.shape[4]
        # Each layer's sliding window as the kernel takes it: keys, 0 for none.
        self.windows = [min(w, 2 ** 31 - 1) if w else 0 for w in backend.windows]
        # paged_attention_rows' arguments after (q, q_row_stride, k_cache, v_cache), up to `out`.
        self.rows_args = (plan.tables.data_ptr(), plan.tables.stride(0), plan.row_idx.data_ptr(),
                          plan.row_seq.data_ptr(), plan.row_len.data_ptr(), plan.tiles.data_ptr(),
                          plan.tiled.data_ptr(), plan.tiled.numel(), backend.num_heads, self.kv_heads, self.d,
                          backend.block_size, backend.scale)

    def _store(self, layer_idx: int, k_p: int, k_stride: int, v_p: int, v_stride: int, num_tokens: int) -> None:
        k_cache, v_cache = self.caches[layer_idx]
        if self.backend.lib.store_kv(k_p, k_stride, v_p, v_stride, k_cache, v_cache, self.plan.slots.data_ptr(),
                                     num_tokens, self.kv_heads * self.d, self.num_slots, self.bf16):
            raise IndexError(f"a slot is past the KV pool's {self.num_slots}")

    def _attend(self, layer_idx: int, q: torch.Tensor, q_p: int, q_stride: int, out: torch.Tensor) -> None:
        """The kernel's rows, then the long prefills through SDPA (q: [T, H, D], a view)."""
        plan, backend = self.plan, self.backend
        if plan.row_idx.numel():
            k_cache, v_cache = self.caches[layer_idx]
            status = backend.lib.paged_attention_rows(q_p, q_stride, k_cache, v_cache, *self.rows_args,
                                                      self.windows[layer_idx], out.data_ptr(), out.stride(0),
                                                      torch.get_num_threads(), self.bf16)
            if status == -2:
                raise MemoryError("CPU paged attention: no memory for the bf16 block buffers")
            assert status == 0, "shapes outside the kernel's buffers (fits() should have said)"
        if plan.long:
            k_cache, v_cache = backend.k_cache[layer_idx], backend.v_cache[layer_idx]
            heads, window = out.view(out.shape[0], -1, self.d), backend.windows[layer_idx]
            for start, q_len, seq_len, tables in plan.long:  # prefill: gather its context, then SDPA
                keys, values = gather_blocks(k_cache, tables, seq_len), gather_blocks(v_cache, tables, seq_len)
                heads[start:start + q_len] = sdpa(q[start:start + q_len], keys, values, backend.scale,
                                                  q_start=seq_len - q_len, window=window)

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, H, D], k/v [T, KV, D] as PagedAttention.forward takes them -> [T, H, D] (into `out`)."""
        heads_packed = all(x.stride(2) == 1 and x.stride(1) == x.shape[2] for x in (k, v))
        if heads_packed and k.dtype == v.dtype == self.backend.k_cache.dtype and \
                self.plan.slots.numel() == k.shape[0]:
            self._store(layer_idx, k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k.shape[0])
        else:
            backend = self.backend
            reshape_and_cache_ref(k, v, backend.k_cache[layer_idx], backend.v_cache[layer_idx],
                                  self.metadata.slot_mapping)
        if q.stride(2) != 1 or q.stride(1) != q.shape[2]:
            q = q.contiguous()  # the kernel needs each row's heads side by side
        out = torch.empty(q.shape, dtype=q.dtype) if out is None else out
        self._attend(layer_idx, q, q.data_ptr(), q.stride(0), out.view(q.shape[0], -1))
        return out

    def fused(self, layer_idx: int, qkv: torch.Tensor, out: torch.Tensor) -> None:
        """qkv [T, (H + 2 KV) D], a row's q, k and v heads side by side (the QKV projection's output,
        rotated): store its K/V, attend, write out [T, H D]."""
        t, width = qkv.shape
        q_p, size = qkv.data_ptr(), qkv.element_size()
        hd, kvd = self.backend.num_heads * self.d, self.kv_heads * self.d
        self._store(layer_idx, q_p + size * hd, width, q_p + size * (hd + kvd), width, t)
        q = qkv[:, :hd].view(t, -1, self.d) if self.plan.long else None
        self._attend(layer_idx, q, q_p, width, out)
