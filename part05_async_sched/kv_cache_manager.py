"""Which blocks each request owns: the request -> block list map on top of the BlockPool.

A request's block list is its *block table*: logical block i (token positions
i*block_size .. (i+1)*block_size-1) lives in physical block block_ids[i]. Blocks are added one at
a time as the request grows, so a request never holds more than one partly filled block, and
memory is committed only for tokens that exist (the contiguous cache of part 01 reserved
prompt + max_tokens up front)."""
from __future__ import annotations

import torch

from .block_pool import BlockPool, KVCacheBlock


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


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}

    def allocate_slots(self, request_id: str, num_tokens: int) -> bool:
        """Make sure `request_id` owns blocks for `num_tokens` tokens in total (tokens already
        cached plus the ones about to be computed). Returns False, allocating nothing, when the
        pool cannot supply the missing blocks: the scheduler then waits or preempts."""
        blocks = self.req_to_blocks.setdefault(request_id, [])
        num_new = cdiv(num_tokens, self.block_size) - len(blocks)
        if num_new <= 0:
            return True
        if num_new > self.block_pool.get_num_free_blocks():
            if not blocks:
                del self.req_to_blocks[request_id]  # leave no empty entry behind
            return False
        blocks.extend(self.block_pool.get_new_blocks(num_new))
        return True

    def free(self, request_id: str) -> None:
        """Return every block of the request to the pool (a no-op for an unknown request)."""
        blocks = self.req_to_blocks.pop(request_id, [])
        # Tail first: the tail block then sits nearer the front of the free queue and is
        # reused before the head. Once blocks carry cached prefixes (part 07), the shared head
        # of a prompt is the part worth keeping longest.
        self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, [])]

    def get_slot_mapping(self, request_id: str, start: int, end: int) -> list[int]:
        """Slots of token positions [start, end) of the request; they must be allocated."""
        if cdiv(end, self.block_size) > len(self.req_to_blocks.get(request_id, [])):
            raise ValueError(f"request {request_id!r} has no blocks for position {end - 1}")
        return compute_slot_mapping(self.get_block_ids(request_id), self.block_size, start, end)

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def usage(self) -> float:
        """Fraction of usable KV blocks in use, 0.0 to 1.0."""
        return self.block_pool.get_usage()
