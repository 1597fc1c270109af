"""The linear layers' GEMM on a CPU, chosen once per layer after loading: our own kernels in place
of oneDNN where they pay, oneDNN's prepacked GEMM (shared/layers.py) elsewhere.

Why. Most of a CPU step is the linear layers, and most of a decode step's share is a few rows
against a weight read from memory, where oneDNN's kernels run well under the machine's peak. Two
kernels stream each weight panel once for all of a step's rows and ask for the next panel while
they work on this one: in fp32 csrc/gemm_cpu.c, compiled for this CPU (the default where the build
has AVX-512; VLLM_COURSE_CPU_GEMM=0 off, =1 on whatever the build), in bf16 csrc/gemm_amx.c on AMX
tiles where the CPU has them (VLLM_COURSE_CPU_AMX=0 off). cpu/README.md has their measurements.

How. The CPU layer factory (layers.py) gives every unquantized linear layer this file's
`CpuUnquantizedLinearMethod`; quantized layers keep their own method (part 14), so quantization
composes with it. Its `process_weights_after_loading` picks the layer's GEMM by its weight's dtype
and shape and packs a copy for the kernel (the dense weight stays the parameter: loaders, the tied
embedding and tests read it). The MLP's gate/up weight is packed with gate and up columns side by
side, so that the graph runner can end the GEMM with the activation (`gemm_gated`); the layer's
own forward gets gate | up from it, the same bits. A row's result does not depend on how many rows
share the call (each output sums its products in one order), so a seeded request samples the same
alone and in a batch, as with oneDNN. torch.compile's tracing, another dtype or a weight the kernel
cannot take keep oneDNN.

In vLLM v0.33.0: vllm/model_executor/layers/utils.py, `dispatch_cpu_unquantized_gemm`, called from
the unquantized linear method's process_weights_after_loading on a CPU, picks per layer between a
oneDNN handle made once per weight and, for small bf16 weights on AMX, sgl-kernel's packed GEMM."""
from __future__ import annotations

from functools import lru_cache
from types import SimpleNamespace

import torch
from torch import nn

from shared.layers import MergedLinear, UnquantizedLinearMethod

from . import envs
from .kernels import load

AMX_TILE = 32  # the AMX kernel's panel width and k-step: N and K must be multiples of it


def load_gemm() -> SimpleNamespace | None:
    """The fp32 kernel when the engine should use it (VLLM_COURSE_CPU_GEMM), or None."""
    return _load_gemm(envs.VLLM_COURSE_CPU_GEMM)


@lru_cache(maxsize=None)
def _load_gemm(switch: str) -> SimpleNamespace | None:
    lib = None if switch == "0" else load("gemm_cpu.c")
    if lib is None:
        return None
    wide = lib.gemm_panel_width() >= 32  # AVX-512: two 16-float vectors a panel
    return lib if switch == "1" or (wide and lib.gemm_threaded()) else None


def load_amx() -> SimpleNamespace | None:
    """The bf16 AMX kernel where the CPU has AMX, the build has it and Linux lends the tiles; else None."""
    return _load_amx(envs.VLLM_COURSE_CPU_AMX and torch.cpu._is_amx_tile_supported())


@lru_cache(maxsize=None)
def _load_amx(wanted: bool) -> SimpleNamespace | None:
    lib = load("gemm_amx.c") if wanted else None
    return lib if lib is not None and lib.amx_init() else None


def pack_weight(lib: SimpleNamespace, weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] fp32 -> the kernel's panels, [ceil(N / NR) * K * NR] floats."""
    n, k = weight.shape
    nr = lib.gemm_panel_width()
    weight = weight.detach().contiguous()
    packed = torch.empty((n + nr - 1) // nr * k * nr, dtype=torch.float32)
    lib.gemm_pack_weight(weight.data_ptr(), n, k, packed.data_ptr())
    return packed


def pack_weight_gated(lib: SimpleNamespace, weight: torch.Tensor) -> torch.Tensor:
    """The MLP's gate/up weight [2I, K] fp32 (gate rows, then up rows) -> panels of gate and up columns
    side by side, [ceil(I / VW) * K * NR] floats (VW = NR / 2)."""
    n, k = weight.shape
    nr = lib.gemm_panel_width()
    weight = weight.detach().contiguous()
    packed = torch.empty((n // 2 + nr // 2 - 1) // (nr // 2) * k * nr, dtype=torch.float32)
    lib.gemm_pack_weight_gated(weight.data_ptr(), n // 2, k, packed.data_ptr())
    return packed


def gemm_gated(lib: SimpleNamespace, x: torch.Tensor, packed: torch.Tensor, inter: int, silu: bool) -> torch.Tensor:
    """x [T, K] fp32 against a gate/up weight packed by pack_weight_gated -> silu(gate) * up [T, inter]
    (`silu`: the MLP's activation in the GEMM's last step), or gate | up [T, 2 inter] as gemm gives."""
    rows = x if x.stride(-1) == 1 else x.contiguous()
    n = inter if silu else 2 * inter
    out = torch.empty((rows.shape[0], n), dtype=torch.float32)
    if rows.shape[0] and lib.gemm_gated(rows.shape[0], inter, rows.shape[1], rows.data_ptr(), rows.stride(0),
                                        packed.data_ptr(), out.data_ptr(), n, int(silu), torch.get_num_threads()):
        raise MemoryError("CPU GEMM: no memory for its copy of x")
    return out


def gemm(lib: SimpleNamespace, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None
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


def amx_fits(weight: torch.Tensor) -> bool:
    n, k = weight.shape
    return n % AMX_TILE == 0 and k % AMX_TILE == 0


def amx_pack_weight(lib: SimpleNamespace, weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] bf16 (N, K multiples of 32) -> the AMX kernel's tiles, [N * K] bf16."""
    n, k = weight.shape
    weight = weight.detach().contiguous()
    packed = torch.empty(n * k, dtype=torch.bfloat16)
    lib.amx_pack_weight(weight.data_ptr(), n, k, packed.data_ptr())
    return packed


def amx_gemm(lib: SimpleNamespace, x: torch.Tensor, packed: torch.Tensor, n: int,
             bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] bf16 @ W^T (+ bias) with W packed by amx_pack_weight -> [..., n] bf16."""
    flat = x.dim() == 2
    rows = x if flat else x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty((rows.shape[0], n), dtype=torch.bfloat16)
    if lib.amx_gemm(rows.shape[0], n, rows.shape[1], rows.data_ptr(), rows.stride(0), packed.data_ptr(),
                    out.data_ptr(), n, None if bias is None else bias.data_ptr(), torch.get_num_threads()):
        raise RuntimeError("AMX GEMM: this build of the kernel has no AMX")
    return out if flat else out.view(*x.shape[:-1], n)


def is_gate_up(layer: nn.Module) -> bool:
    """Two stacked projections of one size and no bias: the MLP's gate/up (gate rows first)."""
    if not isinstance(layer, MergedLinear) or getattr(layer, "bias", None) is not None or len(layer.shards) != 2:
        return False
    (start0, size0), (start1, size1) = layer.shards.values()
    return start0 == 0 and start1 == size0 == size1 and 2 * size0 == layer.weight.shape[0]


class CpuUnquantizedLinearMethod(UnquantizedLinearMethod):
    """The dense method, whose weight processing picks the layer's CPU GEMM once: `layer.gemm`
    is "fp32" (gemm_cpu.c) or "amx" (gemm_amx.c) with the weight packed for it in
    `layer.gemm_weight` (a gate/up weight packed gated: `layer.gemm_gated`), or None for oneDNN."""

    lib: SimpleNamespace | None = None

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        w, bias = layer.weight, getattr(layer, "bias", None)
        layer.gemm, layer.gemm_weight, layer.gemm_gated = None, None, False
        plain = w.device.type == "cpu" and w.dim() == 2 and (
            bias is None or (bias.dtype == w.dtype and bias.is_contiguous()))
        if plain and w.dtype == torch.float32 and (lib := load_gemm()) is not None:
            layer.gemm, layer.gemm_gated = "fp32", is_gate_up(layer)
            layer.gemm_weight = (pack_weight_gated if layer.gemm_gated else pack_weight)(lib, w)
        elif plain and w.dtype == torch.bfloat16 and amx_fits(w) and (lib := load_amx()) is not None:
            layer.gemm, layer.gemm_weight = "amx", amx_pack_weight(lib, w)
        if layer.gemm is None:
            return super().process_weights_after_loading(layer)  # oneDNN's prepacked weight
        self.lib, layer.packed_weight = lib, None  # no oneDNN copy beside ours

    def apply(self, layer, x, bias=None):
        kind = getattr(layer, "gemm", None)
        if kind is None or x.dtype != layer.weight.dtype or torch.compiler.is_compiling():
            return super().apply(layer, x, bias)
        n = layer.weight.shape[0]
        if kind == "amx":
            return amx_gemm(self.lib, x, layer.gemm_weight, n, bias)
        if layer.gemm_gated:
            flat = x.reshape(-1, x.shape[-1])
            return gemm_gated(self.lib, flat, layer.gemm_weight, n // 2, False).view(*x.shape[:-1], n)
        return gemm(self.lib, x, layer.gemm_weight, n, bias)
