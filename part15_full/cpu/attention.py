"""Paged attention on a CPU, reading K/V blocks in place: a small C kernel, built at first use.

Why. The torch path of paged_attention.py gathers every block a step reads into a contiguous copy
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
(`csrc/prefill_tiles.h`, ~190 lines); decode rows go one at a time.
The same library stores the step's new K/V rows in their slots first (store_kv: one call for K
and V, where torch took an index_copy_ each). fp32 or bf16. cpu_build.py compiles it once per
machine; ctypes loads it.
Without a compiler, or if the build fails, a warning says so and the torch path serves (the
engine's results are the same, to float rounding).

Off-switches: VLLM_COURSE_CPU_ATTENTION=0 (the torch path), VLLM_COURSE_CPU_ATTENTION_TILES=0 (prefills
row by row, as decode).

In vLLM v0.33.0: vllm/v1/attention/backends/cpu_attn.py (CPUAttentionBackendImpl, calling
ops.cpu_attn_reshape_and_cache and ops.cpu_attention_with_kv_cache), csrc/cpu/cpu_attn.cpp and
csrc/cpu/cpu_attn_impl.hpp (the kernels, one per ISA)."""
from __future__ import annotations

import contextlib
import ctypes
import logging
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from shared.attention import sdpa

from .attention_metadata import PagedAttentionMetadata
from .cpu_build import CSRC, build
from .kv_cache_manager import cdiv
from .paged_attention import _gather, reshape_and_cache_ref

SOURCE = CSRC / "paged_attention_cpu.c"
SHORT_QUERY = 8  # queries of up to this many tokens always go through the kernel
# A longer query (a prefill) goes through it too while its sequence is at most this long, and
# always when it is a chunk on a cached context. A fresh prefill is plain causal attention, which
# SDPA takes as matrices; on long ones that beats the kernel's tiles of rows (on a Cascade Lake
# Xeon, 30 layers, fp32: the tiles 564 against 636 ms at 1024 tokens, 2125 against 2041 at 2001; the
# bf16 limit was measured on a Zen 4 EPYC with native bf16, before the tiles). A chunk on a context
# needs SDPA with a mask, which falls to its slow unfused path: a 977-token chunk on 1024 cached took
# 4061 ms there against 1540 in the kernel (fp32; bf16 1841 against 1686).
PREFILL_MAX_LEN = {torch.float32: 1024, torch.bfloat16: 256}
ENABLED = os.environ.get("VLLM_COURSE_CPU_ATTENTION", "1") != "0"
TILES = os.environ.get("VLLM_COURSE_CPU_ATTENTION_TILES", "1") != "0"
AMX = os.environ.get("VLLM_COURSE_CPU_ATTENTION_AMX", "1") != "0"  # bf16 decode scores on AMX tiles
logger = logging.getLogger(__name__)


@lru_cache(maxsize=None)
def load_kernel():
    """The kernel's library (bind()), or None (off, no compiler, build failed): then the torch path."""
    if not ENABLED:
        return None
    path = build(SOURCE)
    if path is None:
        logger.warning("CPU paged attention: no kernel, using the torch path (gather + SDPA)")
        return None
    lib = bind(path)
    lib.attention_use_amx(int(AMX and torch.cpu._is_amx_tile_supported()))
    return lib


def bind(path: Path) -> ctypes.CDLL:
    """The library, its two functions' C signatures declared for ctypes."""
    lib = ctypes.CDLL(str(path))
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.paged_attention_rows.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr, ptr, ptr, i32, i32, i32, i32,
                                         i32, ctypes.c_float, ptr, i64, i32, i32]
    lib.store_kv.argtypes = [ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i32]
    lib.attention_use_amx.argtypes = [i32]
    for fn in (lib.paged_attention_rows, lib.store_kv, lib.attention_tile_lanes, lib.attention_use_amx):
        fn.restype = i32
    return lib


_UNRECORDED = contextlib.nullcontext()


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
    return _Plan(metadata.block_tables.to(torch.int32).contiguous(), i32(rows), i32(seqs), i32(lens),
                 i32(tiles + [len(rows)]), torch.tensor(tiled, dtype=torch.uint8), long,
                 metadata.slot_mapping.to(torch.int64).contiguous())


class CpuPagedAttention:
    """The CPU path of PagedAttention.forward: store this step's K/V, then attend."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        # A sequence with more query rows than this in a step is tiled (csrc/prefill_tiles.h).
        self.short_run = SHORT_QUERY if TILES else 2 ** 31 - 1
        self.lanes = lib.attention_tile_lanes()  # a tile of G query heads per KV head holds lanes // G rows
        self._metadata = None  # the step whose plan is cached (the same object for every layer)
        self._plan: _Plan | None = None

    @staticmethod
    def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
        """fp32 or bf16 (q and the pool alike) on the CPU, of shapes the kernel takes (`fits`)."""
        return (q.dtype == k_cache.dtype and q.dtype in (torch.float32, torch.bfloat16) and q.device.type == "cpu"
                and CpuPagedAttention.fits(q.shape[1], k_cache.shape[2], q.shape[2], k_cache.shape[1]))

    @staticmethod
    def fits(heads: int, kv_heads: int, head_dim: int, block_size: int) -> bool:
        """Within the kernel's fixed buffers: up to 16 query heads per KV head, head size and block
        size up to 256."""
        return heads % kv_heads == 0 and heads // kv_heads <= 16 and head_dim <= 256 and block_size <= 256

    def plan(self, metadata: PagedAttentionMetadata, group: int, block_size: int, dtype: torch.dtype) -> _Plan:
        """The step's rows as the kernel takes them, made by its first layer and kept for the others
        (`group`: query heads per KV head)."""
        if metadata is not self._metadata:
            tile_rows = max(1, self.lanes // group)
            self._metadata, self._plan = metadata, _plan(metadata, block_size, dtype, tile_rows, self.short_run)
        return self._plan

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, metadata: PagedAttentionMetadata, scale: float) -> torch.Tensor:
        """q [T, H, D], k/v [T, KV, D] as PagedAttention.forward takes them -> [T, H, D]."""
        block_size = k_cache.shape[1]
        plan, bf16 = self.plan(metadata, q.shape[1] // k_cache.shape[2], block_size, q.dtype), q.dtype == torch.bfloat16
        heads_packed = all(x.stride(2) == 1 and x.stride(1) == x.shape[2] for x in (k, v))
        num_slots = k_cache.shape[0] * block_size
        if heads_packed and k.dtype == v.dtype == k_cache.dtype and plan.slots.numel() == k.shape[0]:
            status = self.lib.store_kv(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k_cache.data_ptr(),
                                       v_cache.data_ptr(), plan.slots.data_ptr(), k.shape[0],
                                       k.shape[1] * k.shape[2], num_slots, bf16)
            if status != 0:
                raise IndexError(f"a slot is past the KV pool's {num_slots}")
        else:
            reshape_and_cache_ref(k, v, k_cache, v_cache, metadata.slot_mapping)
        if q.stride(2) != 1 or q.stride(1) != q.shape[2]:
            q = q.contiguous()  # the kernel needs each row's heads side by side
        out = torch.empty(q.shape, dtype=q.dtype)
        if plan.row_idx.numel():
            # A ctypes call is no torch op: named for the profiler, only when one is on (a
            # record_function costs ~9 us, as much as the kernel call itself for one short row).
            with torch.profiler.record_function("cpu_paged_attention") if torch.autograd._profiler_enabled() \
                    else _UNRECORDED:
                status = self.lib.paged_attention_rows(
                    q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), plan.tables.data_ptr(),
                    plan.tables.stride(0), plan.row_idx.data_ptr(), plan.row_seq.data_ptr(),
                    plan.row_len.data_ptr(), plan.tiles.data_ptr(), plan.tiled.data_ptr(), plan.tiled.numel(),
                    q.shape[1], k_cache.shape[2], q.shape[2], block_size, scale, out.data_ptr(), out.stride(0),
                    torch.get_num_threads(), bf16)
            if status == -2:
                raise MemoryError("CPU paged attention: no memory for the bf16 block buffers")
            assert status == 0, "shapes outside the kernel's buffers (supports() should have said)"
        for start, q_len, seq_len, tables in plan.long:  # prefill: gather its context, then SDPA
            keys, values = _gather(k_cache, tables, seq_len), _gather(v_cache, tables, seq_len)
            out[start:start + q_len] = sdpa(q[start:start + q_len], keys, values, scale, q_start=seq_len - q_len)
        return out

