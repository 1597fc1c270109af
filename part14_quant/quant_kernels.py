"""Matrix products with quantized weights: x [M, K] (fp32/fp16/bf16) @ W^T, W stored in 4 or 8 bits
("W4A16", "W8A16": weights in 4/8 bits, activations in 16 or 32).

At batch 1, a decode step reads every weight once and does two flops with it, so its time is the
time to read the weights: 4-bit weights read 4x (fp16) or 8x (fp32) fewer bytes. That only pays if
the weights are never written back to memory in full precision, so the kernel **dequantizes in
registers**: each program loads a tile of packed int32 words, shifts and masks out its 4-bit (or
8-bit) fields, subtracts the implicit zero, multiplies by the group's scale, and feeds the tile to
`tl.dot`, accumulating in fp32. The GPU kernel (quant_triton.py) reads GPTQ's layout directly
(quant_utils.py): qweight [K / (32/bits), N] int32, scales [K/g, N].

On a CPU, torch offers packed-weight kernels (`torch._weight_int8pack_mm`,
`aten._weight_int4pack_mm_for_cpu`), but on an AVX2 machine (the course's; AVX-512 ones were not
measured) they ran 3-10x slower than fp32 `F.linear` at batch 1 and 20-50x at batch 32
(notebook 14, section 4, times the candidates on the machine it runs on). The fastest correct
path measured there puts the scale *after* the product:
with one scale per (group, output),

    y[m, n] = sum over groups G of  scale[G, n] * (x[m, G] . q[n, G])

so the weights are only converted to floats (no multiply pass), and one batched matmul over the
groups does the rest. int4 values stay packed two per byte (0.5 byte/weight) in a layout of our own
(`pack_for_cpu`): per group, the first half of the group in the low nibbles and the second half in
the high ones, as two's-complement nibbles, so unpacking is a shift or two per half, and each half
multiplies its half of x with no reordering. Measured there at batch 1, cold caches: int8 about
as fast as fp32 with a quarter of the bytes; packed int4 1.2-2.7x fp32's time (unpacking in torch
ops writes the floats to memory; only a fused kernel avoids that).

In vLLM: vllm/model_executor/kernels/linear/mixed_precision/triton_w4a16.py (TritonW4A16, a
Triton kernel of this kind), the MPLinearKernel choice in kernels/linear/__init__.py, and on CPU
the CPUWNA16 kernel. On NVIDIA GPUs vLLM prefers Marlin: a hand-written CUDA kernel that repacks the
weights once at load into a tile order matching the tensor cores, so that batch-1 matmuls run
near the memory-bandwidth limit."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .quant_utils import QuantizedWeight, dequantize, pack_int32, unpack_int32


def wna16_gemm_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bits: int) -> torch.Tensor:
    """The plain-torch meaning of the kernel: unpack, dequantize in fp32, one fp32 matmul."""
    q = unpack_int32(qweight, bits, dim=0).t() - 2 ** (bits - 1)  # [N, K]
    w = dequantize(q, scales.t().float())
    return F.linear(x.float(), w).to(x.dtype)


def pack_for_cpu(qw: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """Our CPU layout: (data int8 [G, N, g] for 8 bits or [G, N, g/2] nibbles for 4, scales [G, N])."""
    n, k = qw.q.shape
    g = qw.group_size
    q = qw.q.reshape(n, k // g, g).transpose(0, 1)  # [G, N, g]
    if qw.bits == 8:
        return q.contiguous(), qw.scales.t().contiguous()
    if g % 2:
        raise ValueError(f"int4 on CPU needs an even group size, got {g}")
    low, high = q[..., :g // 2], q[..., g // 2:]
    data = ((low & 0xF) | (high * 16)).contiguous()  # high in -8..7: high * 16 fits an int8
    return data, qw.scales.t().contiguous()


def _nibbles(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(low, high) nibbles of pack_for_cpu's int8 data as int8 values, sign-extended by shifts."""
    return (data.view(torch.uint8) << 4).view(torch.int8) >> 4, data >> 4


def unpack_cpu(data: torch.Tensor, bits: int) -> torch.Tensor:
    """int8 [G, N, g] values from pack_for_cpu's data."""
    return data if bits == 8 else torch.cat(_nibbles(data), dim=-1)


def wna16_linear_cpu(x: torch.Tensor, data: torch.Tensor, scales: torch.Tensor, bits: int) -> torch.Tensor:
    """x [..., K] @ W^T on the CPU layout: per group, the integer weights as floats, a batched
    matmul, then each group's partial sums times its scale, summed over the groups."""
    groups, n = scales.shape
    xg = x.reshape(-1, groups, x.shape[-1] // groups).transpose(0, 1)  # [G, M, g]
    if bits == 8:
        partial = torch.bmm(xg, data.to(x.dtype).transpose(1, 2))  # [G, M, N]
    else:  # the low nibbles hold each group's first half, the high ones its second: two products
        half, (low, high) = data.shape[-1], _nibbles(data)
        partial = torch.bmm(xg[..., :half], low.to(x.dtype).transpose(1, 2))
        partial = torch.baddbmm(partial, xg[..., half:], high.to(x.dtype).transpose(1, 2))
    out = (partial * scales[:, None, :]).sum(0) if groups > 1 else partial[0] * scales[0]
    return out.reshape(*x.shape[:-1], n)


def use_quantized_weight(layer: nn.Module, qw: QuantizedWeight, layout: str | None = None, pad: int = 0) -> None:
    """Give `layer` its weight in the layout of its device's kernel, as parameters `qweight` and
    `scales`: GPTQ's layout for the Triton kernel on CUDA (`layer.wna16_layout` "gptq"), ours for
    the CPU path ("cpu"). `layout` overrides the choice (tests run the Triton one on CPU)."""
    layer.wna16_bits, layer.wna16_pad = qw.bits, pad  # pad: zero input columns added to fill the last group
    if (layout or ("gptq" if qw.q.is_cuda else "cpu")) == "gptq":  # GPTQ's qweight and scales (the kernel needs no qzeros: the zero is implicit)
        qweight = pack_int32(qw.q.to(torch.int32).t() + 2 ** (qw.bits - 1), qw.bits, dim=0)
        scales, layer.wna16_layout = qw.scales.t().contiguous(), "gptq"
    else:
        (qweight, scales), layer.wna16_layout = pack_for_cpu(qw), "cpu"
    layer.register_parameter("qweight", nn.Parameter(qweight, requires_grad=False))
    layer.register_parameter("scales", nn.Parameter(scales, requires_grad=False))


def apply_wna16(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T + b through the kernel that `use_quantized_weight` prepared the layer for."""
    if layer.wna16_pad:  # inputs padded to whole groups (their weights are zero)
        x = F.pad(x, (0, layer.wna16_pad))
    if layer.wna16_layout == "gptq":
        from .quant_triton import wna16_gemm_triton  # imported on first use: triton is slow to import

        out = wna16_gemm_triton(x.reshape(-1, x.shape[-1]), layer.qweight, layer.scales, layer.wna16_bits)
        out = out.reshape(*x.shape[:-1], out.shape[-1])
    else:
        out = wna16_linear_cpu(x, layer.qweight, layer.scales, layer.wna16_bits)
    return out if bias is None else out + bias
