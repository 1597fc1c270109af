"""The linear layers' GEMM on a CPU in fp32: our own kernel (csrc/gemm_cpu.c) in place of oneDNN.

Why. Part 15's profile on the held-out workload has ~80% of its time in the linear layers, and most
of a decode step's share is a few rows against a weight read from DRAM, where oneDNN's kernels run
at half the machine's FLOP rate (shared/layers.py prepacks for them). The kernel here streams each
weight panel once for all of a step's rows and asks for the next panel while it works on this one:
on a 2-core Cascade Lake Xeon the 30 layers' projections ran 1.4-1.6x faster at 1-32 rows, as fast
at 1024 (the lesson has the table).

How. Each linear layer gets its quantize method from the factory's quant config (shared/layers.py),
as part 14's weight formats do; with no quantization asked, a CPU model runner hands in
`CpuGemmConfig`, whose method keeps the dense weight (loaders, the tied embedding and tests read
it) and, after loading, a copy packed for the kernel in place of oneDNN's. Another dtype, a layer
the kernel cannot take and torch.compile's tracing fall back to the dense method. The MLP's gate/up
weight is packed with gate and up columns side by side, so that the flat forward can end its GEMM
with the activation (`gemm_gated`); the layer's own forward gets gate | up from it, the same bits.
A row's result does not depend on how many rows share the call (the kernel sums every output in one
order), so a seeded request samples the same alone and in a batch, as with oneDNN.

Which build. The kernel is compiled for this CPU (-march=native, cpu_build.py); it is the default
where that build has AVX-512 (measured), and oneDNN stays the default elsewhere (AVX2: not measured
against oneDNN on an AVX2 CPU). VLLM_COURSE_CPU_GEMM=0 turns it off, =1 on whatever the build.

In vLLM v0.33.0: vllm/model_executor/layers/utils.py, `dispatch_cpu_unquantized_gemm`, called from
the unquantized linear method's process_weights_after_loading on a CPU, picks per layer between a
oneDNN handle made once per weight and, for small weights, sgl-kernel's packed-weight GEMM."""
from __future__ import annotations

import ctypes
import logging
import os
from functools import lru_cache
from pathlib import Path

import torch
from torch import nn

from shared.layers import Linear, MergedLinear, QuantizationConfig, UnquantizedLinearMethod

from .cpu_build import CSRC, build

SOURCE = CSRC / "gemm_cpu.c"
SWITCH = os.environ.get("VLLM_COURSE_CPU_GEMM", "auto")  # auto: on where the build has AVX-512
logger = logging.getLogger(__name__)


def bind(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.gemm.argtypes = [i64, i64, i64, ptr, i64, ptr, ptr, i64, ptr, i32]
    lib.gemm.restype = i32
    lib.gemm_pack_weight.argtypes = [ptr, i64, i64, ptr]
    lib.gemm_pack_weight.restype = None
    lib.gemm_gated.argtypes = [i64, i64, i64, ptr, i64, ptr, ptr, i64, i32, i32]
    lib.gemm_gated.restype = i32
    lib.gemm_pack_weight_gated.argtypes = [ptr, i64, i64, ptr]
    lib.gemm_pack_weight_gated.restype = None
    lib.gemm_panel_width.restype = lib.gemm_threaded.restype = i32
    return lib


@lru_cache(maxsize=None)
def load_gemm() -> ctypes.CDLL | None:
    """The kernel's library when the engine should use it (see the module's docstring), or None."""
    if SWITCH == "0":
        return None
    path = build(SOURCE)
    if path is None:
        logger.warning("CPU GEMM kernel: not built, using oneDNN")
        return None
    lib = bind(path)
    wide = lib.gemm_panel_width() >= 32  # AVX-512: two 16-float vectors a panel
    if SWITCH != "1" and not (wide and lib.gemm_threaded()):
        return None
    return lib


def pack_weight(lib: ctypes.CDLL, weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] fp32 -> the kernel's panels, [ceil(N / NR) * K * NR] floats."""
    n, k = weight.shape
    nr = lib.gemm_panel_width()
    weight = weight.detach().contiguous()
    packed = torch.empty((n + nr - 1) // nr * k * nr, dtype=torch.float32)
    lib.gemm_pack_weight(weight.data_ptr(), n, k, packed.data_ptr())
    return packed


def pack_weight_gated(lib: ctypes.CDLL, weight: torch.Tensor) -> torch.Tensor:
    """The MLP's gate/up weight [2I, K] fp32 (gate rows, then up rows) -> panels of gate and up columns
    side by side, [ceil(I / VW) * K * NR] floats (VW = NR / 2)."""
    n, k = weight.shape
    nr = lib.gemm_panel_width()
    weight = weight.detach().contiguous()
    packed = torch.empty((n // 2 + nr // 2 - 1) // (nr // 2) * k * nr, dtype=torch.float32)
    lib.gemm_pack_weight_gated(weight.data_ptr(), n // 2, k, packed.data_ptr())
    return packed


def gemm_gated(lib: ctypes.CDLL, x: torch.Tensor, packed: torch.Tensor, inter: int, silu: bool) -> torch.Tensor:
    """x [T, K] fp32 against a gate/up weight packed by pack_weight_gated -> silu(gate) * up [T, inter]
    (`silu`: the MLP's activation in the GEMM's last step), or gate | up [T, 2 inter] as gemm gives."""
    rows = x if x.stride(-1) == 1 else x.contiguous()
    n = inter if silu else 2 * inter
    out = torch.empty((rows.shape[0], n), dtype=torch.float32)
    if rows.shape[0] and lib.gemm_gated(rows.shape[0], inter, rows.shape[1], rows.data_ptr(), rows.stride(0),
                                        packed.data_ptr(), out.data_ptr(), n, int(silu), torch.get_num_threads()):
        raise MemoryError("CPU GEMM: no memory for its copy of x")
    return out


def gemm(lib: ctypes.CDLL, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None
         ) -> torch.Tensor:
    """x [..., K] fp32 @ W^T (+ bias) with W packed by pack_weight -> [..., n]."""
    flat = x.dim() == 2  # the model's case: no reshape and view around the call (a few us each)
    rows = x if flat else x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty((rows.shape[0], n), dtype=torch.float32)
    if rows.shape[0] and lib.gemm(rows.shape[0], n, rows.shape[1], rows.data_ptr(), rows.stride(0),
                                  packed.data_ptr(), out.data_ptr(), n, None if bias is None else bias.data_ptr(),
                                  torch.get_num_threads()):
        raise MemoryError("CPU GEMM: no memory for its copy of x")
    return out if flat else out.view(*x.shape[:-1], n)


def is_gate_up(layer: nn.Module) -> bool:
    """Two stacked projections of one size and no bias: the MLP's gate/up (gate rows first)."""
    if not isinstance(layer, MergedLinear) or getattr(layer, "bias", None) is not None or len(layer.shards) != 2:
        return False
    (start0, size0), (start1, size1) = layer.shards.values()
    return start0 == 0 and start1 == size0 == size1 and 2 * size0 == layer.weight.shape[0]


class CpuGemmLinearMethod(UnquantizedLinearMethod):
    """The dense method, with an fp32 CPU weight packed for the kernel (`layer.gemm_weight`)
    instead of for oneDNN. A gate/up weight is packed gated (`layer.gemm_gated`): its forward gives
    the same bits, and the flat forward (flat_forward.py) can end the GEMM with the activation."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        w = layer.weight
        layer.gemm_weight = None
        bias = getattr(layer, "bias", None)
        if w.device.type == "cpu" and w.dtype == torch.float32 and w.dim() == 2 and (
                bias is None or (bias.dtype == torch.float32 and bias.is_contiguous())):
            layer.packed_weight = None  # no oneDNN copy beside ours
            layer.gemm_gated = is_gate_up(layer)
            layer.gemm_weight = (pack_weight_gated if layer.gemm_gated else pack_weight)(self.lib, w)
        else:
            super().process_weights_after_loading(layer)

    def apply(self, layer, x, bias=None):
        packed = getattr(layer, "gemm_weight", None)
        if packed is None or x.dtype != torch.float32 or torch.compiler.is_compiling():
            return super().apply(layer, x, bias)
        if layer.gemm_gated:
            flat = x.reshape(-1, x.shape[-1])
            return gemm_gated(self.lib, flat, packed, layer.weight.shape[0] // 2, False).view(
                *x.shape[:-1], layer.weight.shape[0])
        return gemm(self.lib, x, packed, layer.weight.shape[0], bias)


class CpuGemmConfig(QuantizationConfig):
    """No quantization, every linear layer on the CPU GEMM kernel (the model runner's choice)."""

    linear_method = CpuGemmLinearMethod

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib

    def get_name(self) -> str:
        return "cpu_gemm"

    def get_quant_method(self, layer: nn.Module, prefix: str) -> UnquantizedLinearMethod | None:
        return self.linear_method(self.lib) if isinstance(layer, Linear) else None
