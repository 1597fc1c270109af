"""The linear layers' GEMM on a CPU in bf16 with AMX tiles: our own kernel (csrc/gemm_amx.c) in
place of oneDNN, where the CPU has AMX (Sapphire Rapids and later).

Why. In bf16 on such a CPU a matrix product is fast (oneDNN: 2.3 TFLOP/s on 2 cores), so a decode
step is reading weights: SmolLM2-135M's 270 MB a step. oneDNN's kernels read a decode step's
projections at 13-18 GB/s, where one large weight streams at 35-43; the kernel here configures the
tiles once a call and streams each weight panel through them, asking for the panel after next while
it multiplies: the 30 layers' projections plus the LM head at 32 rows 1.3-1.4x faster (the lesson
has the table).

How. As cpu_gemm.py does for fp32: the model runner hands in `AmxGemmConfig` when the model is
bf16 on a CPU with AMX and no quantization is asked; its method keeps the dense weight and, after
loading, a copy packed into the kernel's tiles in place of oneDNN's. A layer whose sizes are not
multiples of 32, another dtype and torch.compile's tracing keep the dense method. A row's result
does not depend on how many rows share the call, as with oneDNN. VLLM_COURSE_CPU_AMX=0 turns it
off (oneDNN then, as every other part does).

In vLLM v0.33.0: vllm/model_executor/layers/utils.py, `dispatch_cpu_unquantized_gemm`: on a CPU
with AMX, bf16 weights of at most 1 MiB (`check_cpu_sgl_kernel`; SmolLM2's o_proj) go to sgl-kernel's
AMX GEMM (`weight_packed_linear`), larger ones to a oneDNN handle made once per weight (as seen in
the 0.32.0 wheel)."""
from __future__ import annotations

import ctypes
import logging
import os
from functools import lru_cache
from pathlib import Path

import torch
from torch import nn

from shared.layers import UnquantizedLinearMethod

from .cpu_build import CSRC, build
from .cpu_gemm import CpuGemmConfig

SOURCE = CSRC / "gemm_amx.c"
SWITCH = os.environ.get("VLLM_COURSE_CPU_AMX", "1") != "0"
TILE = 32  # the kernel's panel width and k-step: N and K must be multiples of it
logger = logging.getLogger(__name__)


def bind(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.amx_init.restype = ctypes.c_int
    lib.amx_pack_weight.argtypes = [ptr, i64, i64, ptr]
    lib.amx_pack_weight.restype = None
    lib.amx_gemm.argtypes = [i64, i64, i64, ptr, i64, ptr, ptr, i64, ptr, ctypes.c_int]
    lib.amx_gemm.restype = ctypes.c_int
    return lib


@lru_cache(maxsize=None)
def load_amx() -> ctypes.CDLL | None:
    """The kernel's library where the CPU has AMX, the build has it and Linux lends the tiles; else None."""
    if not SWITCH or not torch.cpu._is_amx_tile_supported():
        return None
    path = build(SOURCE)
    if path is None:
        logger.warning("AMX GEMM kernel: not built, using oneDNN")
        return None
    lib = bind(path)
    return lib if lib.amx_init() else None


def fits(weight: torch.Tensor) -> bool:
    n, k = weight.shape
    return n % TILE == 0 and k % TILE == 0


def pack_weight(lib: ctypes.CDLL, weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] bf16 (N, K multiples of 32) -> the kernel's tiles, [N * K] bf16."""
    n, k = weight.shape
    weight = weight.detach().contiguous()
    packed = torch.empty(n * k, dtype=torch.bfloat16)
    lib.amx_pack_weight(weight.data_ptr(), n, k, packed.data_ptr())
    return packed


def gemm(lib: ctypes.CDLL, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None
         ) -> torch.Tensor:
    """x [..., K] bf16 @ W^T (+ bias) with W packed by pack_weight -> [..., n] bf16."""
    flat = x.dim() == 2
    rows = x if flat else x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty((rows.shape[0], n), dtype=torch.bfloat16)
    if lib.amx_gemm(rows.shape[0], n, rows.shape[1], rows.data_ptr(), rows.stride(0), packed.data_ptr(),
                    out.data_ptr(), n, None if bias is None else bias.data_ptr(), torch.get_num_threads()):
        raise RuntimeError("AMX GEMM: this build of the kernel has no AMX")
    return out if flat else out.view(*x.shape[:-1], n)


class AmxGemmLinearMethod(UnquantizedLinearMethod):
    """The dense method, with a bf16 CPU weight packed for the AMX kernel (`layer.gemm_weight`)
    instead of for oneDNN."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        w, bias = layer.weight, getattr(layer, "bias", None)
        layer.gemm_weight = None
        if w.device.type == "cpu" and w.dtype == torch.bfloat16 and w.dim() == 2 and fits(w) and (
                bias is None or (bias.dtype == torch.bfloat16 and bias.is_contiguous())):
            layer.packed_weight = None  # no oneDNN copy beside ours
            layer.gemm_weight = pack_weight(self.lib, w)
        else:
            super().process_weights_after_loading(layer)

    def apply(self, layer, x, bias=None):
        packed = getattr(layer, "gemm_weight", None)
        if packed is None or x.dtype != torch.bfloat16 or torch.compiler.is_compiling():
            return super().apply(layer, x, bias)
        return gemm(self.lib, x, packed, layer.weight.shape[0], bias)


class AmxGemmConfig(CpuGemmConfig):
    """No quantization, every linear layer on the AMX GEMM kernel (the model runner's choice)."""

    linear_method = AmxGemmLinearMethod

    def get_name(self) -> str:
        return "cpu_gemm_amx"
