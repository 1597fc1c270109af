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

When every call is one of the part's C kernels (fp32 on the GEMM kernel, the paged attention kernel,
no KV connector), a step goes one further (BoundLayers): the kernels called through ctypes on plain
integers, the weights' addresses taken once and the step's buffers reused by every layer, so that
a layer is nine ctypes calls and nothing else.

Built once after loading: weights changed later need a new one. Off-switches:
VLLM_COURSE_FLAT_FORWARD=0 (the modules), VLLM_COURSE_FLAT_BOUND=0 (this loop, not BoundLayers).

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
from .cpu_gemm_amx import AmxGemmLinearMethod
from .cpu_gemm_amx import gemm as amx_gemm
from .cpu_ops import CpuRMSNorm, CpuRotaryEmbedding, CpuSiluAndMul
from .paged_attention import PagedAttention

ENABLED = os.environ.get("VLLM_COURSE_FLAT_FORWARD", "1") != "0"
BOUND = os.environ.get("VLLM_COURSE_FLAT_BOUND", "1") != "0"


def _linear(layer: Linear) -> Callable[[torch.Tensor], torch.Tensor]:
    """x [T, in] -> [T, out]: the layer's quantize method, or the GEMM kernel called directly."""
    method, bias, packed = layer.quant_method, layer.bias, getattr(layer, "gemm_weight", None)
    if isinstance(method, CpuGemmLinearMethod) and packed is not None:
        lib, n = method.lib, layer.weight.shape[0]
        if layer.gemm_gated:
            return lambda x: gemm_gated(lib, x, packed, n // 2, False)
        return lambda x: gemm(lib, x, packed, n, bias)
    if isinstance(method, AmxGemmLinearMethod) and packed is not None:
        lib, n = method.lib, layer.weight.shape[0]
        return lambda x: amx_gemm(lib, x, packed, n, bias)
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


class BoundLayers:
    """The same loop when every call in it is one of the part's C kernels: each call made straight
    through ctypes with plain integers, the weights' addresses taken once, a step's buffers made
    once and reused by all its layers.

    Why. Even called directly, a kernel's Python wrapper costs more than a decode step's kernel
    does at a few rows: cpu_gemm.gemm spends ~12 us checking its input, allocating the output and
    asking tensors for their addresses around a ~6 us ctypes call, and the attention wrapper
    more. Nine such calls a layer, 30 layers: a few ms a step. Here a step asks for its tensors'
    addresses once and a layer is nine ctypes calls on integers. This is what a CUDA graph does
    on a GPU, by hand: fixed buffers, so that the calls can be laid down once and replayed.

    In fp32 the GEMMs are cpu_gemm.py's kernel (the gate/up one ending with the activation); in bf16
    on a CPU with AMX, cpu_gemm_amx.py's, followed by the SiLU kernel: the same calls either way,
    each kernel taking the model's dtype.

    When. `build` (after loading) checks each layer's modules as FlatForward's do; a step (`__call__`)
    also needs the part's PagedAttention on the CPU kernel with no KV connector (part 13 hooks the
    layers) and a plan with no long prefill (those go to SDPA). Otherwise the step runs
    FlatForward's loop. The same kernels in the same order on the same inputs: the same bits.
    Off-switch: VLLM_COURSE_FLAT_BOUND=0."""

    def __init__(self, lib, layers, dtype: torch.dtype, hidden: int, heads: int, kv_heads: int, d: int, inter: int):
        self.lib, self.layers, self.dtype = lib, layers, dtype
        self.hidden, self.heads, self.kv_heads, self.d, self.inter = hidden, heads, kv_heads, d, inter
        self._backend = self._caches = None

    @classmethod
    def build(cls, model: LlamaForCausalLM) -> BoundLayers | None:
        """None unless every layer runs on the C kernels, in fp32 or in bf16 on AMX, with one shape."""
        dtype, libs, layers, keep, shapes = model.embed_tokens.weight.dtype, set(), [], [], set()
        method = {torch.float32: CpuGemmLinearMethod, torch.bfloat16: AmxGemmLinearMethod}.get(dtype)
        if method is None:
            return None
        gated = dtype == torch.float32  # the fp32 kernel ends the gate/up GEMM with the activation
        ptr = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731 (None: a NULL bias)
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if not all(type(n) is CpuRMSNorm and n.weight.dtype == dtype and _kernels(n, dtype) for n in norms):
                return None
            rotary = attn.rotary
            if not (type(rotary) is CpuRotaryEmbedding and rotary.cos.dtype == torch.float32 and _kernels(rotary, dtype)
                    and type(mlp.act) is CpuSiluAndMul and _kernels(mlp.act, dtype)):
                return None
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if not all(isinstance(m.quant_method, method) and getattr(m, "gemm_weight", None) is not None
                       and getattr(m, "gemm_gated", False) == (gated and m is mlp.gate_up_proj) for m in linears):
                return None
            if mlp.gate_up_proj.bias is not None:
                return None
            shapes.add((attn.num_heads, attn.num_kv_heads, attn.head_dim, mlp.gate_up_proj.weight.shape[0] // 2))
            libs |= {m.quant_method.lib for m in linears}
            bound = [*(n.weight for n in norms), rotary.cos, rotary.sin, *(m.gemm_weight for m in linears),
                     attn.qkv_proj.bias, attn.o_proj.bias, mlp.down_proj.bias]
            keep += [t for t in bound if t is not None]  # held: their addresses must stay theirs
            layers.append((norms[0].weight.data_ptr(), norms[0].eps, attn.qkv_proj.gemm_weight.data_ptr(),
                           ptr(attn.qkv_proj.bias), rotary.cos.data_ptr(), rotary.sin.data_ptr(),
                           rotary.cos.shape[0], attn.layer_idx, attn.o_proj.gemm_weight.data_ptr(),
                           ptr(attn.o_proj.bias), norms[1].weight.data_ptr(), norms[1].eps,
                           mlp.gate_up_proj.gemm_weight.data_ptr(), mlp.down_proj.gemm_weight.data_ptr(),
                           ptr(mlp.down_proj.bias)))
        if len(libs) != 1 or len(shapes) != 1:
            return None
        self = cls(libs.pop(), layers, dtype, model.embed_tokens.weight.shape[1], *shapes.pop())
        self.tensors = keep
        self.ops = _kernels(model.layers[0].input_layernorm, dtype)
        self.rotary = _kernels(model.layers[0].self_attn.rotary, dtype).rotary_embedding
        self.silu = None if gated else _kernels(model.layers[0].mlp.act, dtype).silu_and_mul
        return self

    def _layer_caches(self, backend) -> list | None:
        """Each layer's K and V pool addresses, for a backend this loop can call (else None)."""
        if backend is not self._backend:
            self._backend, self._caches = backend, None
            kernel = getattr(backend, "cpu_kernel", None)
            k_cache = getattr(backend, "k_cache", None)
            if (type(backend) is PagedAttention and kernel is not None and not backend.use_triton
                    and k_cache.dtype == self.dtype and k_cache.shape[3:] == (self.kv_heads, self.d)
                    and kernel.fits(self.heads, self.kv_heads, self.d, k_cache.shape[2])):
                self._caches = [(backend.k_cache[i].data_ptr(), backend.v_cache[i].data_ptr())
                                for i in range(k_cache.shape[0])]
        return self._caches

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, backend, metadata,
                 final_norm: Callable) -> torch.Tensor | None:
        """x: the embedded tokens [T, hidden] (they become the residual) -> the hidden states after
        the final norm, or None when this step cannot run here (FlatForward's loop runs it)."""
        caches = self._layer_caches(backend)
        if caches is None or backend.kv_connector is not None or positions.dtype != torch.int64 \
                or not positions.is_contiguous():
            return None
        t, hidden, heads, kv_heads, d = x.shape[0], self.hidden, self.heads, self.kv_heads, self.d
        block_size = backend.k_cache.shape[2]
        dtype, bf16 = self.dtype, int(self.dtype == torch.bfloat16)
        plan = backend.cpu_kernel.plan(metadata, heads // kv_heads, block_size, dtype)
        if plan.long or plan.slots.numel() != t or positions.numel() != t or not t:
            return None
        lib, ops, rotary, silu = self.lib, self.ops, self.rotary, self.silu
        gemm_ = lib.amx_gemm if bf16 else lib.gemm
        gated, rms, fused_add = None if bf16 else lib.gemm_gated, ops.rms_norm, ops.fused_add_rms_norm
        store_kv, attend = backend.cpu_kernel.lib.store_kv, backend.cpu_kernel.lib.paged_attention_rows
        # The step's buffers: every layer writes the same ones (each is read before the next layer
        # writes it again); `down` ends as the returned hidden states, so a step never sees another's.
        width = (heads + 2 * kv_heads) * d
        qkv, out = torch.empty(t, width, dtype=dtype), torch.empty(t, heads * d, dtype=dtype)
        o, act, down = (torch.empty(t, n, dtype=dtype) for n in (hidden, self.inter, hidden))
        gate_up = None if gated else torch.empty(t, 2 * self.inter, dtype=dtype)  # bf16: SiLU a call apart
        qkv_p, out_p, o_p = qkv.data_ptr(), out.data_ptr(), o.data_ptr()
        act_p, down_p, gate_up_p = act.data_ptr(), down.data_ptr(), 0 if gated else gate_up.data_ptr()
        esz = qkv.element_size()
        k_p, v_p = qkv_p + esz * heads * d, qkv_p + esz * (heads + kv_heads) * d  # the K and V heads of a row
        res = x  # the residual, summed in place
        res_p, pos_p, threads, num_slots = res.data_ptr(), positions.data_ptr(), torch.get_num_threads(), \
            backend.k_cache.shape[1] * block_size
        tables, scale = plan.tables, backend.scale
        attention = (plan.tables.data_ptr(), tables.stride(0), plan.row_idx.data_ptr(), plan.row_seq.data_ptr(),
                     plan.row_len.data_ptr(), plan.tiles.data_ptr(), plan.tiled.data_ptr(), plan.tiled.numel(),
                     heads, kv_heads, d, block_size, scale, out_p, heads * d, threads, bf16)
        slots_p, inter = plan.slots.data_ptr(), self.inter
        first = True
        for (in_w, in_eps, qkv_w, qkv_b, cos, sin, table, idx, o_w, o_b, post_w, post_eps, gate_up_w, down_w,
             down_b) in self.layers:
            if first:  # LlamaDecoderLayer: the first layer's residual is the embedding, normed apart
                rms(res_p, o_p, in_w, t, hidden, in_eps)
                normed, first = o_p, False
            else:
                fused_add(down_p, res_p, in_w, t, hidden, in_eps)
                normed = down_p
            if gemm_(t, width, hidden, normed, hidden, qkv_w, qkv_p, width, qkv_b, threads):
                raise MemoryError("CPU GEMM: no memory for its copy of x")
            if rotary(pos_p, t, qkv_p, width, heads, k_p, width, kv_heads, d, cos, sin, table):
                raise IndexError(f"a position is outside the rotary table (0..{table - 1})")
            k_cache, v_cache = caches[idx]
            if store_kv(k_p, width, v_p, width, k_cache, v_cache, slots_p, t, kv_heads * d, num_slots, bf16):
                raise IndexError(f"a slot is past the KV pool's {num_slots}")
            status = attend(qkv_p, width, k_cache, v_cache, *attention)
            if status:
                raise MemoryError("CPU paged attention: no memory for its buffers") if status == -2 else \
                    AssertionError(f"CPU paged attention: status {status}")
            if gemm_(t, hidden, heads * d, out_p, heads * d, o_w, o_p, hidden, o_b, threads):
                raise MemoryError("CPU GEMM: no memory for its copy of x")
            fused_add(o_p, res_p, post_w, t, hidden, post_eps)
            if gated is not None:
                if gated(t, inter, hidden, o_p, hidden, gate_up_w, act_p, inter, 1, threads):
                    raise MemoryError("CPU GEMM: no memory for its copy of x")
            else:
                if gemm_(t, 2 * inter, hidden, o_p, hidden, gate_up_w, gate_up_p, 2 * inter, None, threads):
                    raise MemoryError("CPU GEMM: no memory for its copy of x")
                silu(gate_up_p, act_p, t, inter)
            if gemm_(t, hidden, inter, act_p, inter, down_w, down_p, hidden, down_b, threads):
                raise MemoryError("CPU GEMM: no memory for its copy of x")
        down, _ = final_norm(down, res)
        return down


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
        self.bound = BoundLayers.build(model) if BOUND else None

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        attend, metadata = ctx.backend.forward, ctx.metadata
        x, residual = self.embed(input_ids), None
        if self.bound is not None and x.dim() == 2:
            out = self.bound(x, positions, ctx.backend, metadata, self.norm)
            if out is not None:
                return out
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
