"""A Triton grouped GEMM for the experts (the GPU path; `experts_reference` in fused_moe.py computes
the same thing and is what it is tested against, under TRITON_INTERPRET=1 on CPU).

The (token, slot) pairs are sorted by expert and each expert's group is padded to a multiple of
BLOCK_M (`align_block_size`), so every block of BLOCK_M rows belongs to one expert. Part 15 does the
sorting on the device into arrays whose sizes follow from the step's shape alone (the most blocks
any routing can need), and the kernel reads how many blocks are real: nothing goes through the
host, so a CUDA graph holds an MoE layer. A program owns
one such block and BLOCK_N output features: it gathers its rows of A (a pair's token row), multiplies
them by its expert's weight tile by tile over K, optionally scales each row by its router weight,
and scatters the rows back to the pairs' places. Two launches make an expert MLP: x @ w13 (gate and
up), SiLU(gate) * up, then @ w2 with the router weights; the k results of a token are then summed.

In vLLM: vllm/model_executor/layers/fused_moe/fused_moe.py (fused_moe_kernel) and
vllm/model_executor/layers/fused_moe/moe_align_block_size.py (moe_align_block_size, on the device)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, b_ptr, c_ptr, weights_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr,
    num_pairs, N, K, top_k,
    stride_am, stride_be, stride_bn, stride_cm,
    MUL_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):  # the grid covers the most blocks any routing needs
        return
    pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs  # padding slots hold num_pairs
    expert = tl.load(block_expert_ptr + pid_m)
    rows = pairs // top_k  # the token each pair reads
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + rows[:, None] * stride_am + offs_k[None, :],
                    mask=valid[:, None] & (offs_k[None, :] < K), other=0.0)
        b = tl.load(b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None],
                    mask=(offs_n[None, :] < N) & (offs_k[:, None] < K), other=0.0)
        acc += tl.dot(a, b)
    if MUL_WEIGHT:
        acc *= tl.load(weights_ptr + pairs, mask=valid, other=0.0)[:, None]
    tl.store(c_ptr + pairs[:, None] * stride_cm + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=valid[:, None] & (offs_n[None, :] < N))


def align_block_size(ids: torch.Tensor, num_experts: int,
                     block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted pair ids padded per expert to a multiple of block_m, num_pairs as padding; the expert
    of each block; how many of the slots are real, [1]). All on the device, sized by the shapes alone:
    each expert's group wastes fewer than block_m slots, so cdiv(pairs, block_m) + num_experts blocks
    always suffice; the blocks past the real ones are padding."""
    flat = ids.flatten()
    n, device = flat.numel(), ids.device
    max_blocks = -(-n // block_m) + num_experts
    counts = torch.zeros(num_experts, dtype=torch.long, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)  # pair ids by expert, in order within one
    expert = flat[order]
    rank = torch.arange(n, device=device) - (counts.cumsum(0) - counts)[expert]  # place within its expert
    sorted_ids = torch.full((max_blocks * block_m,), n, dtype=torch.long, device=device)
    sorted_ids[ends[expert] - padded[expert] + rank] = order
    block_start = torch.arange(max_blocks, device=device) * block_m
    block_expert = torch.searchsorted(ends, block_start, right=True).clamp_(max=num_experts - 1)
    return sorted_ids, block_expert, ends[-1:]


def _grouped_gemm(a: torch.Tensor, b: torch.Tensor, sorted_ids: torch.Tensor, block_expert: torch.Tensor,
                  num_padded: torch.Tensor, num_pairs: int, top_k: int, weights: torch.Tensor | None,
                  block_m: int) -> torch.Tensor:
    n, k = b.shape[1], b.shape[2]
    c = torch.zeros(num_pairs, n, dtype=a.dtype, device=a.device)
    grid = (len(block_expert), triton.cdiv(n, 32))
    a, b = a.contiguous(), b.contiguous()
    _grouped_gemm_kernel[grid](
        a, b, c, weights if weights is not None else c, sorted_ids, block_expert, num_padded,
        num_pairs, n, k, top_k, a.stride(0), b.stride(0), b.stride(1), c.stride(0),
        MUL_WEIGHT=weights is not None, BLOCK_M=block_m, BLOCK_N=32, BLOCK_K=32)
    return c


# A custom op, as vLLM registers its fused MoE: torch.compile and the trace that splits the forward at
# attention (piecewise.py) see one opaque node instead of tracing into a Triton launch.
@torch.library.custom_op("vllm_course::fused_experts", mutates_args=())
def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor,
                  weights: torch.Tensor | None, block_m: int = 16) -> torch.Tensor:
    """x [T, H], ids / weights [T, k] (local expert indices): the weighted sum of each token's k
    experts, [T, H]."""
    t, top_k = ids.shape
    sorted_ids, block_expert, num_padded = align_block_size(ids, w13.shape[0], block_m)
    h = _grouped_gemm(x, w13, sorted_ids, block_expert, num_padded, t * top_k, top_k, None, block_m)  # [T*k, 2I]
    gate, up = h.chunk(2, dim=-1)
    act = (F.silu(gate.float()) * up.float()).to(x.dtype)
    flat_w = None if weights is None else weights.flatten().float().contiguous()
    y = _grouped_gemm(act, w2, sorted_ids, block_expert, num_padded, t * top_k, 1, flat_w, block_m)  # [T*k, H]
    return y.view(t, top_k, -1).sum(dim=1)


@fused_experts.register_fake
def _(x, w13, w2, ids, weights, block_m=16):
    return x.new_empty(x.shape[0], w2.shape[1])
