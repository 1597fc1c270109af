"""The Triton W4A16 / W8A16 GEMM for CUDA (quant_kernels.py explains the idea; its `wna16_gemm_ref`
is the plain-torch meaning this kernel is tested against, under TRITON_INTERPRET=1 on a CPU).
Apart so that a CPU run never imports triton (slow to import, and not needed there)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _wna16_gemm_kernel(x_ptr, qw_ptr, s_ptr, out_ptr, M, N, K, group_size,
                       stride_xm, stride_qk, stride_sg, stride_om,
                       BITS: tl.constexpr, IEEE: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    PER: tl.constexpr = 32 // BITS  # values per int32 word
    MASK: tl.constexpr = (1 << BITS) - 1
    ZERO: tl.constexpr = 1 << (BITS - 1)  # GPTQ's implicit zero: 8 (uint4b8) or 128 (uint8b128)
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=(offs_m[:, None] < M) & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & (offs_n[None, :] < N)
        # Row k of W^T sits in word k // PER, bits (k % PER) * BITS and up.
        words = tl.load(qw_ptr + (offs_k // PER)[:, None] * stride_qk + offs_n[None, :], mask=w_mask, other=0)
        q = (words >> ((offs_k % PER) * BITS)[:, None]) & MASK
        s = tl.load(s_ptr + (offs_k // group_size)[:, None] * stride_sg + offs_n[None, :], mask=w_mask, other=0.0)
        w = ((q - ZERO).to(tl.float32) * s.to(tl.float32)).to(x.dtype)
        if IEEE:  # fp32 activations: a true fp32 product, not TF32
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def wna16_gemm_triton(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bits: int,
                      block_m: int | None = None, block_n: int = 64, block_k: int = 32) -> torch.Tensor:
    """x [M, K] @ W^T with W in GPTQ's layout (qweight [K*bits/32, N] int32, scales [K/g, N]):
    [M, N] in x's dtype."""
    m, k = x.shape
    n = qweight.shape[1]
    if qweight.shape[0] * (32 // bits) != k or k % scales.shape[0]:
        raise ValueError(f"qweight {tuple(qweight.shape)} / scales {tuple(scales.shape)} do not fit K={k}")
    x, qweight, scales = x.contiguous(), qweight.contiguous(), scales.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = block_m or (16 if m <= 16 else 64)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _wna16_gemm_kernel[grid](x, qweight, scales, out, m, n, k, k // scales.shape[0],
                             x.stride(0), qweight.stride(0), scales.stride(0), out.stride(0),
                             BITS=bits, IEEE=x.dtype == torch.float32,
                             BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return out
