"""The C ABI of part 15's CPU kernels: every C function declared once, here, as its C prototype.

Each kernel is a plain C file in csrc/ (build.py compiles it at first use) with no Python in it,
called through ctypes. The declarations below are the only place a function's argument types are
written on the Python side; the modules that use a kernel (attention.py, gemm.py, layers.py,
graph_runner.py) call it through `load(source)`. A function is a `Kernel`: while the torch profiler
records, each call shows up under the function's name (ctypes calls are no torch ops, so the
profiler would see nothing there); otherwise the call goes straight to ctypes.

In vLLM v0.33.0 the CPU kernels are C++ registered as torch custom ops (csrc/cpu/torch_bindings.cpp)
and called as torch.ops._C.<name>. A custom op's dispatch costs microseconds a call, as much as a
decode step's small kernels take; a ctypes call on plain integers costs less."""
from __future__ import annotations

import ctypes
import logging
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace

import torch

from .build import CSRC, build

logger = logging.getLogger(__name__)

# The C prototypes, by source file; `ptr` is any pointer (a tensor's data_ptr(), or None for NULL).
ABI: dict[str, dict[str, str]] = {
    "fused_ops_cpu.c": {  # RMSNorm, the rotary embedding and SiLU x up, each in fp32 and in bf16
        **{f"rms_norm{s}": "void (ptr x, ptr out, ptr w, i64 T, i64 H, f32 eps)" for s in ("", "_bf16")},
        **{f"fused_add_rms_norm{s}": "void (ptr x, ptr residual, ptr w, i64 T, i64 H, f32 eps)"
           for s in ("", "_bf16")},
        **{f"rotary_embedding{s}": "i32 (ptr positions, i64 T, ptr q, i64 q_stride, i32 nq, ptr k, i64 k_stride, "
                                   "i32 nk, i32 D, ptr cos_table, ptr sin_table, i64 max_pos)" for s in ("", "_bf16")},
        **{f"silu_and_mul{s}": "void (ptr x, ptr out, i64 T, i64 I)" for s in ("", "_bf16")},
    },
    "paged_attention_cpu.c": {
        "paged_attention_rows": "i32 (ptr q, i64 q_row_stride, ptr k_cache, ptr v_cache, ptr block_tables, "
                                "i64 table_stride, ptr row_idx, ptr row_seq, ptr row_len, ptr tiles, ptr tiled, "
                                "i32 num_tiles, i32 num_heads, i32 num_kv_heads, i32 head_dim, i32 block_size, "
                                "f32 scale, i32 window, ptr out, i64 out_row_stride, i32 num_threads, i32 bf16)",
        "store_kv": "i32 (ptr k, i64 k_row_stride, ptr v, i64 v_row_stride, ptr k_cache, ptr v_cache, ptr slots, "
                    "i64 num_tokens, i64 row_elems, i64 num_slots, i32 bf16)",
        "attention_tile_lanes": "i32 ()",
        "attention_use_amx": "i32 (i32 on)",
    },
    "gemm_cpu.c": {  # fp32
        "gemm": "i32 (i64 M, i64 N, i64 K, ptr x, i64 ldx, ptr wp, ptr y, i64 ldy, ptr bias, i32 num_threads)",
        "gemm_gated": "i32 (i64 M, i64 inter, i64 K, ptr x, i64 ldx, ptr wp, ptr y, i64 ldy, i32 silu, "
                      "i32 num_threads)",
        "gemm_pack_weight": "void (ptr w, i64 N, i64 K, ptr out)",
        "gemm_pack_weight_gated": "void (ptr w, i64 I, i64 K, ptr out)",
        "gemm_panel_width": "i32 ()",
        "gemm_threaded": "i32 ()",
    },
    "gemm_amx.c": {  # bf16 on AMX tiles
        "amx_init": "i32 ()",
        "amx_pack_weight": "void (ptr w, i64 N, i64 K, ptr out)",
        "amx_gemm": "i32 (i64 M, i64 N, i64 K, ptr x, i64 ldx, ptr wp, ptr y, i64 ldy, ptr bias, i32 num_threads)",
    },
}
_CTYPES = {"void": None, "ptr": ctypes.c_void_p, "i64": ctypes.c_int64, "i32": ctypes.c_int, "f32": ctypes.c_float}


def _signature(prototype: str) -> tuple[object, list]:
    """'i32 (ptr q, i64 n)' -> (restype, argtypes)."""
    restype, _, args = prototype.partition(" (")
    args = args.rstrip(")").strip()
    return _CTYPES[restype], [_CTYPES[a.split()[0]] for a in args.split(",")] if args else []


class Kernel:
    """One C function: called like the ctypes function; named in the profiler's trace when it records."""
    __slots__ = ("name", "fn")

    def __init__(self, name: str, fn):
        self.name, self.fn = name, fn

    def __call__(self, *args):
        if torch.autograd._profiler_enabled():
            with torch.profiler.record_function(self.name):
                return self.fn(*args)
        return self.fn(*args)


def bind(source: str, path: Path) -> SimpleNamespace:
    """The library at `path` (built from csrc/`source`): each function of ABI[source] as a Kernel."""
    lib = ctypes.CDLL(str(path))
    kernels = {}
    for name, prototype in ABI[source].items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = _signature(prototype)
        kernels[name] = Kernel(name, fn)
    return SimpleNamespace(**kernels)


@lru_cache(maxsize=None)
def load(source: str) -> SimpleNamespace | None:
    """csrc/`source`'s functions (built at first use), or None: no compiler, or the build failed (a
    warning says so, and the caller's torch path serves)."""
    path = build(CSRC / source)
    if path is None:
        logger.warning("CPU kernels of %s: not built, the torch path serves", source)
        return None
    return bind(source, path)
