"""The model's forward on a CPU as one flat loop of calls, with the modules' Python taken out.

Why. A decode step makes the same few hundred calls whatever the batch: per layer two norms, four
projections, the rotary embedding, attention and SiLU, each reached through nn.Module's __call__,
attribute lookups and its wrapper's checks. On a GPU, CUDA graphs replay a step's launches without
any of that; on a CPU there is nothing to replay, and the calls are the host's own time. Measured
on the course's Cascade Lake Xeon (lesson 15): SmolLM2's 30 layers at 64 wide, so that the
arithmetic costs next to nothing, decoded one token in 17.9 ms, most of it Python around the
kernels. A real decode step of 80-133 ms pays the same.

How. After loading, `build_flat_forward` checks that the model is the plain Llama decoder whose
forward this file repeats (every layer a LlamaDecoderLayer with LlamaAttention and LlamaMLP, its
linear layers running Linear.forward, no torch.compile), and collects for each layer the bound
methods its modules would call. A linear layer on the CPU GEMM kernel (cpu_gemm.py) becomes one
direct call of the kernel (cpu_gemm.gemm), its weight bound once; the MLP's gate/up product and its
SiLU become one (cpu_gemm.gemm_gated, the activation as the GEMM's last step). The loop makes the
modules' calls in their order, through the same kernels and arithmetic, so the hidden states are
the same bit for bit (tests/test_part15_flat_forward.py); only the Python between the kernels and
the gate/up output's trip through memory are gone. Anything else
(tensor parallelism, MoE blocks, a compiled model, a GPU) keeps the modules.

Built once after loading: weights changed later need a new one. Off-switch:
VLLM_COURSE_FLAT_FORWARD=0.

In vLLM v0.33.0: on a GPU, vllm/compilation/cuda_graph.py (CUDAGraphWrapper) replays captured
steps; on a CPU vLLM compiles the model (vllm/compilation/), and Inductor's generated wrapper is
such a flat function."""
from __future__ import annotations

import os
from typing import Callable

import torch

from shared.forward_context import get_forward_context
from shared.layers import Linear, RMSNorm, RotaryEmbedding, SiluAndMul, VocabEmbedding
from shared.model import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP

from .cpu_gemm import CpuGemmLinearMethod, gemm, gemm_gated
from .cpu_ops import CpuRMSNorm, CpuRotaryEmbedding, CpuSiluAndMul

ENABLED = os.environ.get("VLLM_COURSE_FLAT_FORWARD", "1") != "0"


def _linear(layer: Linear) -> Callable[[torch.Tensor], torch.Tensor]:
    """x [T, in] -> [T, out]: the layer's quantize method, or the GEMM kernel called directly."""
    method, bias, packed = layer.quant_method, layer.bias, getattr(layer, "gemm_weight", None)
    if isinstance(method, CpuGemmLinearMethod) and packed is not None:
        lib, n = method.lib, layer.weight.shape[0]
        if layer.gemm_gated:
            return lambda x: gemm_gated(lib, x, packed, n // 2, False)
        return lambda x: gemm(lib, x, packed, n, bias)
    apply = method.apply
    return lambda x: apply(layer, x, bias)


# The elementwise layers' kernels called directly too. Their forwards check each call's tensors
# (dtype, layout, torch.compile) and fall back to torch when a check fails; in this loop the
# tensors are always the same kind (the model's dtype; rows from a GEMM or a norm, contiguous; q and
# k views into the QKV output, heads side by side), so the checks are made once, here. At a decode
# step's 25 rows that was 25 -> 11 us a norm, 38 -> 14 the rotary embedding, 40 -> 29 SiLU.
def _kernels(module: torch.nn.Module, dtype: torch.dtype):
    ops = getattr(module, "ops", None)
    return None if ops is None else ops.get(dtype)


def _norm(norm: RMSNorm, dtype: torch.dtype) -> Callable:
    """(x) -> norm(x), (x, residual) -> (norm(x + residual), x + residual): CpuRMSNorm.forward's
    kernels, in place where it is."""
    kernels = _kernels(norm, dtype) if type(norm) is CpuRMSNorm and norm.weight.dtype == dtype else None
    if kernels is None:
        return norm.forward
    rms, fused_add = kernels.rms_norm, kernels.fused_add_rms_norm
    weight, hidden, eps = norm.weight.data_ptr(), norm.weight.shape[0], norm.eps

    def call(x, residual=None):
        if residual is None:
            out = torch.empty_like(x)
            rms(x.data_ptr(), out.data_ptr(), weight, x.numel() // hidden, hidden, eps)
            return out
        fused_add(x.data_ptr(), residual.data_ptr(), weight, x.numel() // hidden, hidden, eps)
        return x, residual
    return call


def _rotary(rotary: RotaryEmbedding, dtype: torch.dtype) -> Callable:
    """(positions, q, k) -> (q, k) rotated in place: CpuRotaryEmbedding.forward's kernel."""
    kernels = _kernels(rotary, dtype) if type(rotary) is CpuRotaryEmbedding and rotary.cos.dtype == torch.float32 \
        else None
    if kernels is None:
        return rotary.forward
    fn, d, cos, sin, table = kernels.rotary_embedding, rotary.head_dim, rotary.cos, rotary.sin, rotary.cos.shape[0]

    def call(positions, q, k):
        if positions.dtype != torch.int64 or not positions.is_contiguous():
            return rotary.forward(positions, q, k)
        if fn(positions.data_ptr(), positions.numel(), q.data_ptr(), q.stride(0), q.shape[1], k.data_ptr(),
              k.stride(0), k.shape[1], d, cos.data_ptr(), sin.data_ptr(), table):
            raise IndexError(f"a position is outside the rotary table (0..{table - 1})")
        return q, k
    return call


def _silu(act: SiluAndMul, dtype: torch.dtype) -> Callable:
    """x [..., 2I] -> silu(x[..., :I]) * x[..., I:]: CpuSiluAndMul.forward's kernel."""
    kernels = _kernels(act, dtype) if type(act) is CpuSiluAndMul else None
    if kernels is None:
        return act.forward
    fn = kernels.silu_and_mul

    def call(x):
        half = x.shape[-1] // 2
        out = x.new_empty(*x.shape[:-1], half)
        fn(x.data_ptr(), out.data_ptr(), x.numel() // x.shape[-1], half)
        return out
    return call


def _gate_up_act(gate_up: Linear, act: SiluAndMul, dtype: torch.dtype) -> Callable:
    """x -> act(gate_up(x)). With the gate/up weight packed gated and CpuSiluAndMul's kernel, one GEMM
    whose last step is the activation: the [T, 2I] gate | up never goes to memory and back, and the
    activation's call is gone. The same operations as the two calls, so the same bits."""
    method, packed = gate_up.quant_method, getattr(gate_up, "gemm_weight", None)
    if (isinstance(method, CpuGemmLinearMethod) and packed is not None and gate_up.gemm_gated
            and dtype == torch.float32 and _kernels(act, dtype) is not None and type(act) is CpuSiluAndMul):
        lib, inter = method.lib, gate_up.weight.shape[0] // 2
        return lambda x: gemm_gated(lib, x, packed, inter, True)
    linear, silu = _linear(gate_up), _silu(act, dtype)
    return lambda x: silu(linear(x))


def _is_plain(model: torch.nn.Module) -> bool:
    """The Llama decoder as shared/model.py writes it, eager, every projection a Linear.forward."""
    if type(model) is not LlamaForCausalLM or "forward" in vars(model):  # compiled: forward replaced
        return False
    if type(model.embed_tokens).forward is not VocabEmbedding.forward or not isinstance(model.norm, RMSNorm):
        return False
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not (type(layer) is LlamaDecoderLayer and type(attn) is LlamaAttention and type(mlp) is LlamaMLP):
            return False
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if not all(isinstance(m, Linear) and type(m).forward is Linear.forward for m in linears):
            return False
        if not (isinstance(layer.input_layernorm, RMSNorm) and isinstance(layer.post_attention_layernorm, RMSNorm)
                and isinstance(attn.rotary, RotaryEmbedding) and isinstance(mlp.act, SiluAndMul)):
            return False
    return True


class FlatForward:
    """model(input_ids, positions) -> hidden states, the same, without the modules' calls."""

    def __init__(self, model: LlamaForCausalLM):
        self.embed = model.embed_tokens.forward
        dtype = model.embed_tokens.weight.dtype  # the hidden states' (the norms keep it)
        self.norm = _norm(model.norm, dtype)
        self.layers = []
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            heads_split = [attn.num_heads, attn.num_kv_heads, attn.num_kv_heads]
            self.layers.append((_norm(layer.input_layernorm, dtype), _linear(attn.qkv_proj), heads_split,
                                attn.num_heads, attn.num_kv_heads, attn.head_dim, _rotary(attn.rotary, dtype),
                                attn.layer_idx, _linear(attn.o_proj), _norm(layer.post_attention_layernorm, dtype),
                                _gate_up_act(mlp.gate_up_proj, mlp.act, dtype), _linear(mlp.down_proj)))

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        attend, metadata = ctx.backend.forward, ctx.metadata
        x, residual = self.embed(input_ids), None
        for in_norm, qkv, sizes, heads, kv_heads, d, rotary, idx, o, post_norm, gate_up_act, down in self.layers:
            # LlamaDecoderLayer.forward, with LlamaAttention's and LlamaMLP's inlined.
            if residual is None:
                residual, x = x, in_norm(x)
            else:
                x, residual = in_norm(x, residual)
            t = x.shape[0]
            # The modules' split and three views, as one op (the same views: one token's heads side by side).
            q, k, v = torch.split_with_sizes(qkv(x).view(t, heads + 2 * kv_heads, d), sizes, dim=1)
            q, k = rotary(positions, q, k)
            x = o(attend(idx, q, k, v, metadata).reshape(t, heads * d))
            x, residual = post_norm(x, residual)
            x = down(gate_up_act(x))
        x, _ = self.norm(x, residual)
        return x


def build_flat_forward(model: torch.nn.Module, device: torch.device) -> FlatForward | None:
    """A FlatForward of a loaded CPU model, or None (switched off, or not the plain decoder)."""
    if not ENABLED or device.type != "cpu" or not _is_plain(model):
        return None
    return FlatForward(model)
