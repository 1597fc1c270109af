"""The decoder's elementwise work on a CPU in fused C kernels: RMSNorm with its residual add, the
rotary embedding, SiLU x up.

Why. After the GEMMs and attention, part 15's profile on the held-out workload had ~13% of the
time in small torch ops: RMSNorm alone is seven of them (add, pow, mean, add, rsqrt, mul, mul), the
rotary embedding a dozen (two gathers of the cos/sin table in every layer, then mul, cat, neg,
add), SiLU x up three. At decode a step has a few dozen rows, so each op costs its launch and a
pass over memory, not its arithmetic. vLLM's CPU build runs these as C++ kernels (and its compiled
graph fuses what is left); torch.compile here did not pay on a CPU (compilation.py). Each kernel
in csrc/fused_ops_cpu.c is one pass over the rows.

How. The shared model builds these layers through its LayerFactory (`rms_norm`, `rotary_embedding`,
`silu_and_mul`); `CpuKernelLayers` wraps the part's factory and returns subclasses whose forward
calls the kernel when the tensors are fp32 or bf16 on the CPU, and the torch forward otherwise
(another dtype or device, or while torch.compile traces). The rotary kernel rotates q and k in
place, as vLLM's op does: they are views into the fused QKV projection's fresh output. bf16 is
computed in fp32 and rounded once where it is stored (the torch layers round after every op).

Off-switch: VLLM_COURSE_CPU_FUSED_OPS=0.

In vLLM v0.33.0: the layers are CustomOps (vllm/model_executor/custom_op.py picks a forward per
platform): RMSNorm in vllm/model_executor/layers/layernorm.py (ops.rms_norm, ops.fused_add_rms_norm,
in place), RotaryEmbedding in vllm/model_executor/layers/rotary_embedding/base.py
(ops.rotary_embedding, in place), SiluAndMul in vllm/model_executor/layers/activation.py
(ops.silu_and_mul); the CPU build's kernels are csrc/cpu/layernorm.cpp, pos_encoding.cpp and
activation.cpp."""
from __future__ import annotations

import ctypes
import logging
import os
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace

import torch

from shared.config import ModelConfig
from shared.layers import RMSNorm, RotaryEmbedding, SiluAndMul
from shared.model import LayerFactory, WrappedLayers

from .cpu_build import CSRC, build

SOURCE = CSRC / "fused_ops_cpu.c"
ENABLED = os.environ.get("VLLM_COURSE_CPU_FUSED_OPS", "1") != "0"
logger = logging.getLogger(__name__)


# The element types the kernels take, each by the suffix of its C functions (fused_ops_cpu.c).
KERNEL_DTYPES = {torch.float32: "", torch.bfloat16: "_bf16"}


@lru_cache(maxsize=None)
def load_ops():
    """The kernels by element type (bind()), or None (off, no compiler, build failed)."""
    if not ENABLED:
        return None
    path = build(SOURCE)
    if path is None:
        logger.warning("fused CPU ops: no kernels, using the torch layers")
        return None
    return bind(path)


def bind(path: Path) -> dict[torch.dtype, SimpleNamespace]:
    """The library's functions with their C signatures: {dtype: its four kernels}."""
    lib = ctypes.CDLL(str(path))
    ptr, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    signatures = {"rms_norm": ([ptr, ptr, ptr, i64, i64, f32], None),
                  "fused_add_rms_norm": ([ptr, ptr, ptr, i64, i64, f32], None),
                  "rotary_embedding": ([ptr, i64, ptr, i64, i32, ptr, i64, i32, i32, ptr, ptr, i64], i32),
                  "silu_and_mul": ([ptr, ptr, i64, i64], None)}
    kernels = {}
    for dtype, suffix in KERNEL_DTYPES.items():
        fns = {}
        for name, (argtypes, restype) in signatures.items():
            fn = getattr(lib, name + suffix)
            fn.argtypes, fn.restype = argtypes, restype
            fns[name] = fn
        kernels[dtype] = SimpleNamespace(**fns)
    return kernels


# The checks below are few and cheap on purpose: at decode a layer's norm is a few microseconds of
# work, and every torch call on the way to the kernel costs about a microsecond of Python.
def _kernels(ops: dict, x: torch.Tensor) -> SimpleNamespace | None:
    """The kernels for x's element type (on the CPU: these layers are only built for it), or None:
    another dtype, or traced by torch.compile (a ctypes call cannot be traced)."""
    return None if torch.compiler.is_compiling() else ops.get(x.dtype)


class CpuRMSNorm(RMSNorm):
    def __init__(self, hidden_size: int, eps: float, ops: dict):
        super().__init__(hidden_size, eps)
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """With `residual`, in place: residual += x, x = norm(residual); returns (x, residual)."""
        kernels = _kernels(self.ops, x)
        if not (kernels and self.weight.dtype == x.dtype and x.is_contiguous()
                and (residual is None or (residual.dtype == x.dtype and residual.is_contiguous()))):
            return super().forward(x, residual)
        hidden = x.shape[-1]
        if residual is None:  # the first layer's: x is kept as the residual, so not in place
            out = torch.empty_like(x)
            kernels.rms_norm(x.data_ptr(), out.data_ptr(), self.weight.data_ptr(), x.numel() // hidden, hidden,
                             self.eps)
            return out
        kernels.fused_add_rms_norm(x.data_ptr(), residual.data_ptr(), self.weight.data_ptr(),
                                   x.numel() // hidden, hidden, self.eps)
        return x, residual


class CpuRotaryEmbedding(RotaryEmbedding):
    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None, ops: dict):
        super().__init__(head_dim, max_position, theta, scaling)
        self.ops = ops

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """Rotates q [T, heads, D] and k [T, kv_heads, D] in place and returns them. Each token's
        heads must lie side by side (views into the QKV output do). The cos/sin table stays fp32."""
        d = self.head_dim
        kernels = _kernels(self.ops, q)
        if not (kernels and k.dtype == q.dtype and self.cos.dtype == torch.float32
                and positions.dtype == torch.int64 and q.stride(2) == k.stride(2) == 1
                and q.stride(1) == k.stride(1) == d and positions.is_contiguous()):
            return super().forward(positions, q, k)
        status = kernels.rotary_embedding(
            positions.data_ptr(), positions.numel(), q.data_ptr(), q.stride(0), q.shape[1],
            k.data_ptr(), k.stride(0), k.shape[1], d, self.cos.data_ptr(), self.sin.data_ptr(),
            self.cos.shape[0])
        if status != 0:
            raise IndexError(f"a position is outside the rotary table (0..{self.cos.shape[0] - 1})")
        return q, k


class CpuSiluAndMul(SiluAndMul):
    def __init__(self, ops: dict):
        super().__init__()
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels = _kernels(self.ops, x)
        if not (kernels and x.is_contiguous()):
            return super().forward(x)
        half = x.shape[-1] // 2
        out = x.new_empty(*x.shape[:-1], half)
        kernels.silu_and_mul(x.data_ptr(), out.data_ptr(), x.numel() // x.shape[-1], half)
        return out


class CpuKernelLayers(WrappedLayers):
    """`base`'s layers, with the elementwise ones on the fused kernels. Built over a plain (dense or
    tensor-parallel) factory; an MoE factory may wrap it. `ops`: the kernels by element type (load_ops())."""

    def __init__(self, base: LayerFactory, ops: dict):
        super().__init__(base)
        self.ops = ops

    # The dense MLP recipe with this factory's layers (WrappedLayers.mlp would look for the
    # recipe in the base, and an MoE wrapper over this one would find this method again).
    mlp = LayerFactory.mlp

    def rms_norm(self, cfg: ModelConfig) -> RMSNorm:
        return CpuRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, self.ops)

    def rotary_embedding(self, cfg: ModelConfig, max_positions: int) -> RotaryEmbedding:
        return CpuRotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, self.ops)

    def silu_and_mul(self) -> SiluAndMul:
        return CpuSiluAndMul(self.ops)
