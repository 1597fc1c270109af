"""The CPU implementation of the runner seam (graph_runner.py): a step as one loop of the part's C
kernels, the weights bound once at capture.

Why. A decode step makes the same few hundred calls whatever the batch: per layer two norms, four
projections, the rotary embedding, attention and SiLU, each reached through nn.Module's __call__,
attribute lookups and its layer's checks, each costing microseconds of Python around a kernel of a
few microseconds at a decode step's rows. On a GPU a CUDA graph replays a step's launches without
any of that; on a CPU there is nothing to replay, and the calls are the host's own time.

How. `build` checks that the model is the plain Llama decoder of shared/model.py (every layer a
LlamaDecoderLayer with LlamaAttention and LlamaMLP, eager, its elementwise layers on the fused
kernels of layers.py) and that attention is the C kernel's backend (attention.py); `capture` then takes each layer's weights, as the kernels want
them, once. `replay` runs a step of any size as the modules would: the same kernels in the same
order on the same inputs, so the hidden states are the same bit for bit
(tests/test_part15_graph_runner.py). A step's buffers are made once and reused by every layer; the
attention's plan is made once a step (`bind_step`). A linear layer on one of gemm.py's kernels is a
kernel call on raw addresses (in fp32 the MLP's gate/up GEMM ends with the activation), any other
(oneDNN, a quantized format of part 14) one call of its method. Anything else (tensor parallelism, MoE blocks, a compiled
model, a KV connector's per-layer hooks) keeps the modules (graph_runner.GraphRunner).

Off-switch: VLLM_COURSE_CPU_RUNNER=0 (envs.py).

In vLLM v0.33.0: on a GPU, vllm/compilation/cuda_graph.py (CUDAGraphWrapper) replays captured
steps; on a CPU vLLM compiles the model (vllm/compilation/), and Inductor's generated wrapper is
such a flat function."""
from __future__ import annotations

from typing import Callable

import torch

from shared.layers import Linear, VocabEmbedding
from shared.model import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP

from . import envs
from ..graph_runner import GraphRunner
from .attention import CpuAttention
from .gemm import CpuUnquantizedLinearMethod
from .layers import CpuRMSNorm, CpuRotaryEmbedding, CpuSiluAndMul

Gemm = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x, a buffer it may write) -> y


def _is_plain(model: torch.nn.Module, dtype: torch.dtype) -> bool:
    """The Llama decoder as shared/model.py writes it, eager, on this appendix's layers and kernels."""
    if type(model) is not LlamaForCausalLM or "forward" in vars(model):  # compiled: forward replaced
        return False
    if type(model.embed_tokens).forward is not VocabEmbedding.forward or type(model.norm) is not CpuRMSNorm \
            or model.norm.weight.dtype != dtype:
        return False
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not (type(layer) is LlamaDecoderLayer and type(attn) is LlamaAttention and type(mlp) is LlamaMLP):
            return False
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if not all(type(m).forward is Linear.forward for m in linears):
            return False
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if not (all(type(n) is CpuRMSNorm and n.weight.dtype == dtype for n in norms)
                and type(attn.rotary) is CpuRotaryEmbedding and attn.rotary.cos.dtype == torch.float32
                and type(mlp.act) is CpuSiluAndMul):
            return False
    return True


def _gemm(layer: Linear) -> Gemm:
    """x [T, in] -> [T, out]: the kernel gemm.py picked for the layer, called on raw addresses into the
    buffer it is given, or the layer's method (oneDNN, a quantized format), which returns a fresh tensor."""
    method, bias = layer.quant_method, layer.bias
    if not isinstance(method, CpuUnquantizedLinearMethod) or layer.gemm is None:
        apply = method.apply
        return lambda x, out: apply(layer, x, bias)
    fn = method.lib.gemm if layer.gemm == "fp32" else method.lib.amx_gemm
    n, k, w, b = layer.weight.shape[0], layer.weight.shape[1], layer.gemm_weight.data_ptr(), \
        0 if bias is None else bias.data_ptr()

    def call(x, out):
        if fn(x.shape[0], n, k, x.data_ptr(), x.stride(0), w, out.data_ptr(), n, b or None, torch.get_num_threads()):
            raise MemoryError("CPU GEMM: no memory for its copy of x")
        return out
    return call


def _gate_up_act(gate_up: Linear, silu) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """(x, gate_up buffer, act buffer) -> silu(gate) * up [T, I]. On the fp32 kernel with the weight
    packed gated, one GEMM whose last step is the activation (the same bits as the two calls)."""
    inter = sum(gate_up.output_partition_sizes) // 2
    if getattr(gate_up, "gemm", None) == "fp32" and gate_up.gemm_gated:
        fn, w = gate_up.quant_method.lib.gemm_gated, gate_up.gemm_weight.data_ptr()

        def fused(x, _, act):
            if fn(x.shape[0], inter, x.shape[1], x.data_ptr(), x.stride(0), w, act.data_ptr(), inter, 1,
                  torch.get_num_threads()):
                raise MemoryError("CPU GEMM: no memory for its copy of x")
            return act
        return fused
    gemm = _gemm(gate_up)

    def two_calls(x, buf, act):
        y = gemm(x, buf)
        silu(y.data_ptr(), act.data_ptr(), y.shape[0], inter)
        return act
    return two_calls


class CpuGraphRunner(GraphRunner):
    """Replays any step of the plain decoder on the C kernels (see the module's docstring)."""

    @classmethod
    def build(cls, model: torch.nn.Module, attn) -> CpuGraphRunner | None:
        """A runner for this model and backend, or None (switched off, or not a model it can run)."""
        dtype = model.embed_tokens.weight.dtype if hasattr(model, "embed_tokens") else None
        if not envs.VLLM_COURSE_CPU_RUNNER or not isinstance(attn, CpuAttention) or attn.k_cache.dtype != dtype \
                or not _is_plain(model, dtype):
            return None
        shapes = {(layer.self_attn.num_heads, layer.self_attn.num_kv_heads, layer.self_attn.head_dim,
                   sum(layer.mlp.gate_up_proj.output_partition_sizes) // 2) for layer in model.layers}
        if len(shapes) != 1 or next(iter(shapes))[:3] != (attn.num_heads, attn.k_cache.shape[3], attn.k_cache.shape[4]):
            return None
        return cls(model, attn)

    def capture(self) -> None:
        """Each layer's weights and kernels, bound once: a step of any size replays with them."""
        model = self.model
        first = model.layers[0]
        ops = first.input_layernorm.ops[model.embed_tokens.weight.dtype]
        self.rms, self.fused_add, self.rotary = ops.rms_norm, ops.fused_add_rms_norm, ops.rotary_embedding
        attn, self.hidden = first.self_attn, model.embed_tokens.weight.shape[1]
        self.heads, self.kv_heads, self.d = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.inter = sum(first.mlp.gate_up_proj.output_partition_sizes) // 2
        self.layers = []
        for layer in model.layers:
            attn, mlp, rotary = layer.self_attn, layer.mlp, layer.self_attn.rotary
            norm_in, norm_post = layer.input_layernorm, layer.post_attention_layernorm
            self.layers.append((norm_in.weight.data_ptr(), norm_in.eps, _gemm(attn.qkv_proj),
                                rotary.cos.data_ptr(), rotary.sin.data_ptr(), rotary.cos.shape[0], attn.layer_idx,
                                _gemm(attn.o_proj), norm_post.weight.data_ptr(), norm_post.eps,
                                _gate_up_act(mlp.gate_up_proj, ops.silu_and_mul), _gemm(mlp.down_proj)))
        self.final_norm = (model.norm.weight.data_ptr(), model.norm.eps)

    def padded_size(self, num_tokens: int, metadata) -> int | None:
        # A KV connector hooks every layer's attention (part 13): the modules run those steps.
        return num_tokens if num_tokens and self.attn.kv_connector is None else None

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata, size: int) -> torch.Tensor:
        """LlamaForCausalLM.forward, as the modules' calls would make it, on raw addresses."""
        step = self.attn.bind_step(metadata)
        res = self.model.embed_tokens(input_ids)  # the residual, summed in place
        t, hidden, heads, kv_heads, d, inter = res.shape[0], self.hidden, self.heads, self.kv_heads, self.d, self.inter
        if positions.dtype != torch.int64 or not positions.is_contiguous() or positions.numel() != t:
            raise ValueError("positions must be t contiguous int64 values")
        # The step's buffers: every layer writes the same ones, each read before the next layer
        # writes it again; the last `down` is the returned hidden states.
        width, dtype = (heads + 2 * kv_heads) * d, res.dtype
        qkv_buf, out = torch.empty(t, width, dtype=dtype), torch.empty(t, heads * d, dtype=dtype)
        o_buf, act, down_buf = (torch.empty(t, n, dtype=dtype) for n in (hidden, inter, hidden))
        gate_up = torch.empty(t, 2 * inter, dtype=dtype)
        k_offset = qkv_buf.element_size() * heads * d  # the K heads of a row, after its q heads
        rms, fused_add, rotary, res_p, pos_p = self.rms, self.fused_add, self.rotary, res.data_ptr(), positions.data_ptr()
        x = None
        for in_w, in_eps, qkv_gemm, cos, sin, table, idx, o_gemm, post_w, post_eps, gate_up_act, down_gemm \
                in self.layers:
            if x is None:  # LlamaDecoderLayer: the first layer's residual is the embedding, normed apart
                rms(res_p, o_buf.data_ptr(), in_w, t, hidden, in_eps)
                x = o_buf
            else:
                fused_add(x.data_ptr(), res_p, in_w, t, hidden, in_eps)
            qkv = qkv_gemm(x, qkv_buf)
            qkv_p = qkv.data_ptr()
            if rotary(pos_p, t, qkv_p, width, heads, qkv_p + k_offset, width, kv_heads, d, cos, sin, table):
                raise IndexError(f"a position is outside the rotary table (0..{table - 1})")
            step.fused(idx, qkv, out)
            x = o_gemm(out, o_buf)
            fused_add(x.data_ptr(), res_p, post_w, t, hidden, post_eps)
            x = down_gemm(gate_up_act(x, gate_up, act), down_buf)
        norm_w, norm_eps = self.final_norm
        fused_add(x.data_ptr(), res_p, norm_w, t, hidden, norm_eps)  # the model's final norm
        return x
