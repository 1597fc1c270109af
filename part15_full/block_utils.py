"""The arithmetic of fixed-size KV blocks, which both sides of the engine need: the scheduler's side
(the KV cache manager counts a request's blocks and maps its tokens to slots) and the runner's (the
attention metadata, the backends slicing block tables, the pool sized from a memory budget). Neither
side imports the other for it.

In vLLM v0.33.0: vllm/utils/math_utils.py (cdiv), vllm/v1/worker/block_table.py (compute_slot_mapping)
and vllm/v1/core/kv_cache_utils.py (the number of blocks a memory budget holds)."""
from __future__ import annotations

import torch


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def compute_slot_mapping(block_ids: list[int], block_size: int, start: int, end: int) -> list[int]:
    """The flat cache slot of each token position in [start, end) of one request:
    slot = block_ids[pos // block_size] * block_size + pos % block_size.
    The KV cache viewed as [num_blocks * block_size, ...] is indexed by these slots."""
    return [block_ids[pos // block_size] * block_size + pos % block_size
            for pos in range(start, end)]


def num_blocks_for_budget(memory_bytes: int, num_layers: int, num_kv_heads: int, head_dim: int,
                          block_size: int, dtype: torch.dtype) -> int:
    """How many blocks fit in `memory_bytes`. One block holds K and V of `block_size` tokens in
    every layer. The count includes the reserved null block (BlockPool keeps one back)."""
    bytes_per_block = 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize
    return memory_bytes // bytes_per_block
