"""Weight-only quantization arithmetic: symmetric int8/int4 per channel or per group, and the bit
layouts that store the result (our nibbles, GPTQ's int32 words, compressed-tensors' pack-quantized).

Number formats, per weight:

    fp32  4 bytes  8-bit exponent, 24-bit significand: ~7 decimal digits, range ~1e-38..3.4e38
    bf16  2 bytes  fp32's exponent (same range), 8-bit significand: ~2-3 digits (rel. step 2^-8)
    fp16  2 bytes  5-bit exponent: range 6e-5 (normal)..65504, 11-bit significand (~3 digits)
    int8  1 byte   integers -128..127: 256 evenly spaced levels, no exponent at all
    int4  0.5 byte integers -8..7: 16 levels; two share a byte, eight an int32

An integer carries no exponent, so it stands for `q * scale` with a floating-point scale shared by
many weights. **Symmetric** quantization centres the grid on zero: scale = max|w| / qmax
(qmax = 127 for int8, 7 for int4), q = round(w / scale), and dequantizing gives q * scale, within
scale / 2 of w. Who shares a scale: **per channel**, one scale per output row (a row of [N, K]);
**per group**, one per `group_size` consecutive inputs of a row (32/64/128), so an outlier spoils
only its group's resolution; int4 needs groups (16 levels per row lose too much), int8 does fine
per channel. A scale per 128 weights costs 2 bytes / 128 = 1/8 bit per weight.

Asymmetric quantization (AWQ's, and GPTQ's `sym=False`) adds an integer **zero point** z per group:
w ~ (q - z) * scale with q in 0..2^bits-1, scale = (max - min) / (2^bits - 1). A group whose
values are not centred on zero (all positive, say) then uses all 2^bits levels instead of half of
them: at 4 bits that is worth having, since every level counts. The price is a zero per group
(packed like the weights) and a subtraction in the kernel. This course keeps to symmetric formats.

GPTQ's layout (AutoGPTQ / GPTQModel checkpoints, `bits` 4 or 8), for a weight W [N, K]:
`qweight` int32 [K / (32/bits), N]: packed along the *input* dim K, word j of column n holds
W[n, 8j..8j+7] (4-bit), element i in bits [4i, 4i+4), low bits first; values stored unsigned with
an implicit zero of 2^(bits-1) (8: "uint4b8"; 128: "uint8b128"). `scales` [K/g, N] (g = K when
group_size is -1). `qzeros` int32 [K/g, N / (32/bits)]: zeros packed along N; the original (v1)
format stores zero - 1 (7 for 4-bit symmetric), GPTQModel's `gptq_v2` the zero itself.
`g_idx` int32 [K]: the group of each input, i // g (permuted by act-order, which we refuse).
compressed-tensors' `pack-quantized` stores the row-major way: `weight_packed` int32
[N, K / (32/bits)] packed along K, values offset by +2^(bits-1), low bits first; `weight_scale`
[N, K/g]; `weight_shape` [N, K].

In vLLM: vllm/model_executor/layers/quantization/utils/quant_utils.py (pack_rows, gptq_pack,
quantize_weights), quantization/gptq.py (v0.11) and auto_gptq.py (v0.33), compressed-tensors'
compressors/pack_quantized, and vllm/scalar_type.py (uint4b8, uint8b128)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

BITS = (4, 8)


def qmax(bits: int) -> int:
    """The largest level of a symmetric `bits`-bit grid (127, 7); the grid is -qmax..qmax."""
    if bits not in BITS:
        raise ValueError(f"{bits}-bit weights are not supported (choose one of {BITS})")
    return 2 ** (bits - 1) - 1


def group_size_for(k: int, group_size: int | None) -> int:
    """The number of inputs sharing a scale: `group_size`, or all k (per channel) for None / -1."""
    if group_size is None or group_size == -1:
        return k
    if group_size <= 0:
        raise ValueError(f"group size must be positive or -1 (per channel), got {group_size}")
    if k % group_size:
        raise ValueError(f"input size {k} is not a multiple of the quantization group size {group_size}; "
                         f"{group_size_hint(k)}")
    return group_size


def group_size_hint(k: int) -> str:
    """What to do about a group size that does not divide k inputs."""
    fits = [g for g in (128, 64, 32) if k % g == 0]
    if not fits:
        return "no group size of 32, 64 or 128 divides it (int8, per channel, has no groups)"
    return "choose one that divides it: " + " or ".join(f"--quantization-group-size {g}" for g in fits)


@dataclass
class QuantizedWeight:
    """q int8 [N, K] on the grid -qmax..qmax (int4 values unpacked here); scales [N, K / g]."""
    q: torch.Tensor
    scales: torch.Tensor
    bits: int

    @property
    def group_size(self) -> int:
        return self.q.shape[1] // self.scales.shape[1]


def quantize_symmetric(w: torch.Tensor, bits: int, group_size: int | None = None,
                       scale_dtype: torch.dtype | None = None) -> QuantizedWeight:
    """Round w [N, K] onto a symmetric grid, one scale per row (group_size None) or per group.
    The scale is rounded to its storage dtype first and q computed from the stored scale, so
    |w - q * scale| <= scale / 2 holds for the scale the kernel will read (up to fp32 rounding of
    w / scale: at most qmax * 2^-24 * scale more)."""
    if w.dim() != 2:
        raise ValueError(f"expected a 2-D weight [out, in], got shape {tuple(w.shape)}")
    n, k = w.shape
    g, top = group_size_for(k, group_size), qmax(bits)
    groups = w.float().reshape(n, k // g, g)
    scales = (groups.abs().amax(dim=-1) / top).to(scale_dtype or w.dtype)
    scales = torch.where(scales == 0, torch.ones_like(scales), scales)  # an all-zero group: q = 0
    q = torch.round(groups / scales.float()[..., None]).clamp_(-top, top).to(torch.int8)
    return QuantizedWeight(q.reshape(n, k), scales, bits)


def dequantize(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """q [N, K] integers and scales [N, K / g] -> q * scale [N, K] in `dtype` (the scales' dtype)."""
    n, k = q.shape
    g = k // scales.shape[1]
    w = q.reshape(n, k // g, g).to(scales.dtype) * scales[..., None]
    return w.reshape(n, k).to(dtype or scales.dtype)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int4 values (-8..7, any int dtype) [..., K] -> uint8 [..., K/2]: value + 8 in a nibble,
    element 2i in the low nibble and 2i+1 in the high one."""
    if q.shape[-1] % 2:
        raise ValueError(f"int4 packing needs an even last dim, got {q.shape[-1]}")
    u = (q.to(torch.int16) + 8)
    if u.min() < 0 or u.max() > 15:
        raise ValueError("int4 values must lie in -8..7")
    u = u.to(torch.uint8)
    return u[..., 0::2] | (u[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_int4: uint8 [..., K/2] -> int8 [..., K] in -8..7."""
    low = (packed & 0xF).to(torch.int8) - 8
    high = (packed >> 4).to(torch.int8) - 8
    return torch.stack((low, high), dim=-1).flatten(-2)


def pack_int32(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned `bits`-bit values -> int32 words along `dim`: 32/bits per word, element i of a
    word in bits [i*bits, (i+1)*bits) (low bits first). The top element may set the sign bit:
    the word is the same 32 bits, read as a signed int32."""
    per = 32 // bits
    if values.shape[dim] % per:
        raise ValueError(f"dim {dim} of size {values.shape[dim]} does not divide into int32 words "
                         f"of {per} {bits}-bit values")
    v = values.to(torch.int64).movedim(dim, -1)
    if v.numel() and (v.min() < 0 or v.max() >= 2 ** bits):
        raise ValueError(f"values to pack must lie in 0..{2 ** bits - 1}")
    v = v.reshape(*v.shape[:-1], -1, per)
    shifts = torch.arange(per, device=v.device) * bits
    words = (v << shifts).sum(dim=-1)  # disjoint bit fields: the sum is their OR
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words)  # as signed 32-bit
    return words.to(torch.int32).movedim(-1, dim).contiguous()


def unpack_int32(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The inverse of pack_int32: int32 words -> unsigned values (int32), 32/bits per word."""
    per = 32 // bits
    w = words.movedim(dim, -1)
    shifts = torch.arange(per, device=w.device, dtype=torch.int32) * bits
    v = (w[..., None] >> shifts) & (2 ** bits - 1)  # arithmetic shift, then the mask drops the sign
    return v.flatten(-2).movedim(-1, dim).contiguous()


def gptq_pack(qw: QuantizedWeight, checkpoint_format: str = "gptq") -> dict[str, torch.Tensor]:
    """Our symmetric weight -> GPTQ's tensors (see the module docstring): qweight, qzeros,
    scales, g_idx. `checkpoint_format` "gptq" (v1) stores each zero minus one, "gptq_v2" the zero."""
    n, k = qw.q.shape
    offset = 2 ** (qw.bits - 1)
    g = qw.group_size
    zero = offset - 1 if checkpoint_format == "gptq" else offset
    zeros = torch.full((k // g, n), zero, dtype=torch.int32, device=qw.q.device)
    return {"qweight": pack_int32(qw.q.to(torch.int32).t() + offset, qw.bits, dim=0),
            "qzeros": pack_int32(zeros, qw.bits, dim=1),
            "scales": qw.scales.t().contiguous(),
            "g_idx": torch.arange(k, dtype=torch.int32, device=qw.q.device) // g}


def gptq_unpack(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, bits: int,
                checkpoint_format: str = "gptq") -> QuantizedWeight:
    """GPTQ's tensors -> our symmetric weight (q [N, K] int8, scales [N, K/g]). Refuses zeros that
    are not the symmetric one: those belong to an asymmetric checkpoint."""
    offset = 2 ** (bits - 1)
    want = offset - 1 if checkpoint_format == "gptq" else offset
    zeros = unpack_int32(qzeros, bits, dim=1)
    if zeros.numel() and not bool((zeros == want).all()):
        raise ValueError(f"GPTQ qzeros hold zero points other than the symmetric {want} "
                         f"({checkpoint_format}): an asymmetric checkpoint, which is not supported")
    q = (unpack_int32(qweight, bits, dim=0) - offset).to(torch.int8).t().contiguous()
    if q.shape[1] % scales.shape[0]:
        raise ValueError(f"qweight's {q.shape[1]} inputs do not split into {scales.shape[0]} groups")
    return QuantizedWeight(q, scales.t().contiguous(), bits)


def ct_pack(qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    """Our symmetric weight -> compressed-tensors pack-quantized (weight_packed [N, K*bits/32],
    weight_scale [N, K/g], weight_shape [2])."""
    n, k = qw.q.shape
    packed = pack_int32(qw.q.to(torch.int32) + 2 ** (qw.bits - 1), qw.bits, dim=1)
    return {"weight_packed": packed, "weight_scale": qw.scales.clone(),
            "weight_shape": torch.tensor([n, k], dtype=torch.int64)}


def ct_unpack(weight_packed: torch.Tensor, weight_scale: torch.Tensor, weight_shape: torch.Tensor,
              bits: int) -> QuantizedWeight:
    n, k = (int(v) for v in weight_shape)
    if weight_packed.shape != (n, k * bits // 32) or k * bits % 32:
        raise ValueError(f"weight_packed {tuple(weight_packed.shape)} does not hold a [{n}, {k}] "
                         f"{bits}-bit weight")
    q = (unpack_int32(weight_packed, bits, dim=1) - 2 ** (bits - 1)).to(torch.int8)
    return QuantizedWeight(q, weight_scale, bits)
