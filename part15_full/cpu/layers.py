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
`silu_and_mul`); `CpuLayers` wraps the part's factory (and gives its linear layers the method that
picks a CPU GEMM, gemm.py) and returns subclasses whose forward calls the kernel when the tensors are fp32 or bf16 on the CPU, and the torch forward otherwise
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

from types import SimpleNamespace

import torch
from torch import nn

from shared.config import ModelConfig
from shared.layers import Linear, RMSNorm, RotaryEmbedding, SiluAndMul, UnquantizedLinearMethod
from shared.model import LayerFactory, WrappedLayers

from . import envs
from .gemm import CpuUnquantizedLinearMethod
from .kernels import load


# The element types the kernels take, each by the suffix of its C functions (fused_ops_cpu.c).
KERNEL_DTYPES = {torch.float32: "", torch.bfloat16: "_bf16"}


def load_ops() -> dict[torch.dtype, SimpleNamespace] | None:
    """The kernels by element type, {dtype: its four kernels}, or None (off, no compiler, build failed)."""
    if not envs.VLLM_COURSE_CPU_FUSED_OPS:
        return None
    lib = load("fused_ops_cpu.c")
    return None if lib is None else by_dtype(lib)


def by_dtype(lib: SimpleNamespace) -> dict[torch.dtype, SimpleNamespace]:
    """fused_ops_cpu.c's functions, {dtype: its four kernels}."""
    names = ("rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul")
    return {dtype: SimpleNamespace(**{n: getattr(lib, n + suffix) for n in names})
            for dtype, suffix in KERNEL_DTYPES.items()}


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
    def __init__(self, rotary: RotaryEmbedding, ops: dict):
        """The kernel over `rotary`'s cos/sin table (whatever its base and scaling)."""
        nn.Module.__init__(self)
        self.head_dim = self.rotary_dim = rotary.head_dim
        self.register_buffer("cos", rotary.cos, persistent=False)
        self.register_buffer("sin", rotary.sin, persistent=False)
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


def _cpu_gemm(layer: Linear) -> Linear:
    """An unquantized linear layer's method becomes the one that picks a CPU GEMM after loading (gemm.py);
    a quantized layer keeps its own. The weights the method created stay as they are: the two
    methods create the same ones."""
    if type(layer.quant_method) is UnquantizedLinearMethod:
        layer.quant_method = CpuUnquantizedLinearMethod()
    return layer


class CpuLayers(WrappedLayers):
    """`base`'s layers for a CPU: every unquantized linear layer on the GEMM its weight processing
    picks (gemm.py), and, with `ops` (load_ops()), the elementwise layers on the fused kernels. Built
    over a plain (dense or tensor-parallel) factory; an MoE factory may wrap it."""

    def __init__(self, base: LayerFactory, ops: dict | None):
        super().__init__(base)
        self.ops = ops

    # The dense MLP recipe with this factory's layers (WrappedLayers.mlp would look for the
    # recipe in the base, and an MoE wrapper over this one would find this method again).
    mlp = LayerFactory.mlp

    def qkv_proj(self, cfg: ModelConfig, prefix: str):
        return _cpu_gemm(self.base.qkv_proj(cfg, prefix))

    def o_proj(self, cfg: ModelConfig, prefix: str):
        return _cpu_gemm(self.base.o_proj(cfg, prefix))

    def gate_up_proj(self, cfg: ModelConfig, prefix: str):
        return _cpu_gemm(self.base.gate_up_proj(cfg, prefix))

    def down_proj(self, cfg: ModelConfig, prefix: str):
        return _cpu_gemm(self.base.down_proj(cfg, prefix))

    def lm_head(self, cfg: ModelConfig, prefix: str):
        return _cpu_gemm(self.base.lm_head(cfg, prefix))

    def rms_norm(self, cfg: ModelConfig) -> RMSNorm:
        if self.ops is None:
            return self.base.rms_norm(cfg)
        return CpuRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, self.ops)

    def rotary_embedding(self, cfg: ModelConfig, max_positions: int,
                         layer_type: str = "full_attention") -> RotaryEmbedding:
        rotary = self.base.rotary_embedding(cfg, max_positions, layer_type)
        if self.ops is None or rotary.rotary_dim != rotary.head_dim:  # the kernel rotates whole heads
            return rotary
        return CpuRotaryEmbedding(rotary, self.ops)

    def silu_and_mul(self) -> SiluAndMul:
        return self.base.silu_and_mul() if self.ops is None else CpuSiluAndMul(self.ops)
