"""Triton kernels of the paged attention backend (the GPU path; the torch reference in
paged_attention.py computes the same thing and is what they are tested against).

- reshape_and_cache: one program per new token copies its K and V [KV, D] into its slot.
- paged_attention: ONE varlen kernel for decode, fresh prefill and prefill on cached context,
  in the spirit of vLLM's unified Triton attention. A program owns (sequence, KV head, block of
  query rows). It walks that sequence's keys in tiles, finding each key's physical block in the
  block table, and keeps a running (online) softmax in fp32, so no [q_len, seq_len] score matrix
  is ever materialised. A sliding-window layer masks keys older than the window and starts its walk
  at the first tile its rows can see (so it reads O(window) keys, not O(seq_len)); Gemma 2's
  soft-cap squashes the scores with a tanh before the softmax.

On CPU the kernels run under TRITON_INTERPRET=1 (set before triton is imported)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_metadata import PagedAttentionMetadata


@triton.jit
def _reshape_and_cache_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,  # new k, v: [T, KV, D], last dim contiguous
    stride_cb, stride_cs, stride_ch,  # caches: [num_blocks, block_size, KV, D], same strides
    BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    KV_PAD: tl.constexpr, D_PAD: tl.constexpr,  # powers of 2 >= the real sizes (tl.arange)
):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t)  # int64, so the cache offsets below cannot overflow
    if slot < 0:  # a padding token: nothing to store
        return
    block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    h = tl.arange(0, KV_PAD)[:, None]
    d = tl.arange(0, D_PAD)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    dst = block * stride_cb + offset * stride_cs + h * stride_ch + d
    tl.store(k_cache_ptr + dst, tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask), mask=mask)
    tl.store(v_cache_ptr + dst, tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask), mask=mask)


def reshape_and_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store the new k, v [T, KV, D] in their slots of k_cache, v_cache [N, block_size, KV, D]."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    _reshape_and_cache_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        BLOCK_SIZE=k_cache.shape[1], NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        KV_PAD=triton.next_power_of_2(num_kv_heads), D_PAD=triton.next_power_of_2(head_dim))


@triton.jit
def _paged_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    scale,
    window,  # a row at position i sees keys i - window < j <= i (read only if USE_WINDOW)
    softcap,  # scores become softcap * tanh(score / softcap) (read only if USE_SOFTCAP)
    stride_qt, stride_qh, stride_ot, stride_oh,  # q, out: [T, H, D], last dim contiguous
    stride_cb, stride_cs, stride_ch,  # caches: [num_blocks, block_size, KV, D], same strides
    stride_bt,  # block_tables: [B, max_blocks]
    BLOCK_SIZE: tl.constexpr,  # tokens per KV block
    QUERIES_PER_KV: tl.constexpr,  # H // KV: query heads sharing one KV head (GQA)
    QPKV_PAD: tl.constexpr,  # QUERIES_PER_KV rounded up to a power of 2
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_M: tl.constexpr,  # rows of the score tile = BLOCK_Q * QPKV_PAD (>= 16 for tl.dot)
    TILE_N: tl.constexpr,  # keys per loop iteration (>= 16 for tl.dot)
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    # Compile-time switches, so a plain layer's kernel is exactly the one without these features;
    # the window and cap values themselves are runtime arguments, fixed per layer for the whole
    # run, so a model compiles at most two variants (sliding and global layers), both at warm-up.
    USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_block = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= q_len:  # the grid is sized for the longest query; most exit here
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # tokens cached before this step

    # GQA: the QUERIES_PER_KV heads that read this KV head are stacked as extra rows, so the
    # program loads each K/V tile once for all of them, and even a decode step (one query token)
    # has enough rows for a tensor-core dot. Row m = (query token m // QPKV_PAD, head m % QPKV_PAD).
    m = tl.arange(0, BLOCK_M)
    q_tok = q_block * BLOCK_Q + m // QPKV_PAD  # index among this sequence's new tokens
    head = kv_head * QUERIES_PER_KV + m % QPKV_PAD
    row_ok = (q_tok < q_len) & (m % QPKV_PAD < QUERIES_PER_KV)
    q_pos = context_len + q_tok  # absolute position: the causal limit of the row
    d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = d < HEAD_DIM

    q = tl.load(q_ptr + (q_start + q_tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    # Online softmax: m_i is the running max score of each row, l_i the running sum of
    # exp(score - m_i), acc the running sum of exp(score - m_i) * V. When a new tile raises the
    # max, the old sums are rescaled by exp(old max - new max). All in fp32.
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)

    # No row of this program sees a key past its last query token: stop the loop there.
    kv_end = tl.minimum(seq_len, context_len + (q_block + 1) * BLOCK_Q)
    kv_start = 0
    if USE_WINDOW:
        # Nor, with a window, a key before the first one its first (earliest) row sees: start at
        # that key's tile, so a sliding layer never walks the tiles every row has left behind.
        first_key = tl.maximum(context_len + q_block * BLOCK_Q - window + 1, 0)
        kv_start = (first_key // TILE_N) * TILE_N
    for tile_start in range(kv_start, kv_end, TILE_N):
        n = tile_start + tl.arange(0, TILE_N)  # key positions of this tile
        n_ok = n < kv_end
        # Paging: key position n lives in logical block n // BLOCK_SIZE, whose physical block
        # the block table gives; within it, at offset n % BLOCK_SIZE.
        block = tl.load(block_tables_ptr + seq * stride_bt + n // BLOCK_SIZE, mask=n_ok, other=0)
        kv_off = block.to(tl.int64) * stride_cb + (n % BLOCK_SIZE) * stride_cs + kv_head * stride_ch

        k = tl.load(k_cache_ptr + kv_off[None, :] + d[:, None],  # K transposed: [D, TILE_N]
                    mask=n_ok[None, :] & d_ok[:, None], other=0.0)
        s = tl.dot(q, k, input_precision="ieee") * scale  # [BLOCK_M, TILE_N]
        if USE_SOFTCAP:
            # tanh(x) = 2 * sigmoid(2x) - 1 (tl has no tanh the interpreter runs), in fp32; capped
            # before the mask, since the cap of a -inf would be a finite -softcap.
            s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)
        seen = (n[None, :] <= q_pos[:, None]) & n_ok[None, :]
        if USE_WINDOW:
            seen = seen & (n[None, :] > q_pos[:, None] - window)
        s = tl.where(seen, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Without a window every row sees key 0 in the first tile, so m_new is finite from then
        # on and exp(-inf - m_new) is a clean 0 (no -inf - -inf = NaN).
        m_sub = m_new
        if USE_WINDOW:
            # A row whose window starts past this tile has seen no key yet: its max is -inf, and
            # exp(-inf - -inf) would be NaN. Subtracting 0 instead keeps p, alpha, l_i and acc at a
            # clean 0; m_i stays -inf, so its first real max replaces it (and alpha is 0 then).
            # Every real row sees its own key, so l_i ends > 0.
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_sub[:, None])
        alpha = tl.exp(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)

        v = tl.load(v_cache_ptr + kv_off[:, None] + d[None, :],  # [TILE_N, D]
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    if USE_WINDOW:  # a padding row past the last query token may see no key: no 0 / 0 (not stored)
        l_i = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_i[:, None]
    tl.store(out_ptr + (q_start + q_tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    metadata: PagedAttentionMetadata, scale: float,
                    out: torch.Tensor | None = None, window: int | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    """Causal attention of the new tokens q [T, H, D] over each sequence's cached K/V
    (this step's K/V already stored). Returns out [T, H, D]. `window`: a token at position i
    sees keys i - window < j <= i only; `softcap`: tanh-capped scores (as paged_attention_ref)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    q = _last_dim_contiguous(q)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    assert out.stride(-1) == 1 and k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    if num_tokens == 0 or metadata.num_seqs == 0:
        return out

    queries_per_kv = num_heads // num_kv_heads
    qpkv_pad = triton.next_power_of_2(queries_per_kv)
    # tl.dot on a GPU needs every dimension >= 16. Decode-only batches use the smallest tile;
    # prefill gets more query rows per program so each K/V tile is reused more.
    block_m = max(16 if metadata.max_query_len <= 1 else 64, qpkv_pad)
    block_q = block_m // qpkv_pad
    grid = (metadata.num_seqs, num_kv_heads, triton.cdiv(metadata.max_query_len, block_q))
    _paged_attention_kernel[grid](
        out, q, k_cache, v_cache,
        metadata.block_tables, metadata.seq_lens, metadata.query_start_loc,
        scale, window or 0, softcap or 0.0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        metadata.block_tables.stride(0),
        BLOCK_SIZE=k_cache.shape[1], QUERIES_PER_KV=queries_per_kv, QPKV_PAD=qpkv_pad,
        BLOCK_Q=block_q, BLOCK_M=block_m, TILE_N=32,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        USE_WINDOW=window is not None, USE_SOFTCAP=softcap is not None)
    return out


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    # The model hands q/k/v as views of one fused QKV output: rows are strided, which the
    # kernels accept, but elements within a head must be adjacent.
    return x if x.stride(-1) == 1 else x.contiguous()
