"""The pool of fixed-size KV blocks and the queue of the free ones, as in vLLM V1, now a cache.

The KV cache is one preallocated tensor cut into `num_blocks` blocks of `block_size` token slots.
This file only does the bookkeeping: which block ids are free, how many holders each used block
has, and which full blocks hold known content (their hash, see kv_cache_utils.py). No tensor is
touched here.

Prefix caching (part 07) keeps a map from block hash to block. A freed block keeps its hash and
its place in the map: it sits in the free queue, still reusable by a request with the same prefix,
until it is popped for new content. Only then is it evicted (its hash dropped): eviction is lazy,
and the free queue's order (freed longest ago first) makes it least-recently-used. A hit on a free
cached block takes it out of the free queue again (`touch`).

Block 0 is reserved as the *null block*: it is never handed out and never written, so the model
runner can pad block tables with 0 and a padded entry still points at a real, harmless block
(vLLM reserves it the same way). The pool therefore has `num_blocks - 1` usable blocks."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from .kv_cache_utils import BlockHash


@dataclass(eq=False)  # identity, not field equality: blocks are linked objects
class KVCacheBlock:
    block_id: int
    # How many requests hold this block; it goes back to the free queue at 0. Part 07 (prefix
    # cache) shares blocks between requests, which is why this is a count and not a flag.
    ref_cnt: int = 0
    is_null: bool = False
    block_hash: BlockHash | None = None  # set while the block is in the cache's map
    # Links of the free queue; None while the block is in use. repr=False: printing a block
    # must not walk the whole chain.
    prev_free_block: KVCacheBlock | None = field(default=None, repr=False)
    next_free_block: KVCacheBlock | None = field(default=None, repr=False)


class FreeKVCacheBlockQueue:
    """A doubly linked list of free blocks threaded through the blocks themselves.

    A Python deque would give O(1) popleft and append, but not O(1) removal from the middle,
    which prefix caching needs when a free-but-cached block is hit again (`BlockPool.touch`). Two sentinel blocks (head and
    tail) remove every special case for an empty list or an end element.

    Order is the eviction order: blocks are taken from the front and freed ones go to the back,
    so the block freed longest ago is reused first (LRU)."""

    def __init__(self, blocks: list[KVCacheBlock]):
        self.num_free_blocks = len(blocks)
        self._head = KVCacheBlock(block_id=-1)
        self._tail = KVCacheBlock(block_id=-1)
        chain = [self._head, *blocks, self._tail]
        for prev, nxt in zip(chain, chain[1:]):
            prev.next_free_block, nxt.prev_free_block = nxt, prev

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free_block
        if block is self._tail:
            raise ValueError("no free blocks left")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free blocks, only {self.num_free_blocks} left")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise RuntimeError(f"block {block.block_id} is not in the free queue")
        prev.next_free_block, nxt.prev_free_block = nxt, prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free_block
        last.next_free_block, block.prev_free_block = block, last
        block.next_free_block, self._tail.prev_free_block = self._tail, block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            self.append(block)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Front to back; for tests and debugging (O(n))."""
        out, block = [], self._head.next_free_block
        while block is not self._tail:
            out.append(block)
            block = block.next_free_block
        return out


class BlockPool:
    """Owns every KVCacheBlock; hands out free ones, takes them back, and remembers the content
    of full ones (`cached_block_hash_to_block`) until they are evicted."""

    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ValueError("need at least 2 blocks: the null block and one usable block")
        self.num_blocks = num_blocks
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        self.num_evictions = 0
        self.blocks = [KVCacheBlock(block_id=i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # Block 0 is the null block (see the module docstring): taken out once, never returned.
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` free blocks, each with ref_cnt 1. Raises if there are not enough:
        callers check `get_num_free_blocks()` first (KVCacheManager.allocate_slots does)."""
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"cannot allocate {num_blocks} blocks: "
                             f"only {self.get_num_free_blocks()} free")
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            assert block.ref_cnt == 0, f"free block {block.block_id} still has holders"
            self._evict(block)  # it is about to be overwritten
            block.ref_cnt = 1
        return blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add a holder to each block of a cache hit; a free one leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def cache_full_blocks(self, blocks: list[KVCacheBlock], block_hashes: list[BlockHash],
                          start: int, end: int) -> None:
        """Enter blocks[start:end] (full, their content final once this step runs) in the map.
        A hash already mapped to another block (two requests computed the same block side by
        side, or a full hit recomputed its last block) keeps the block it has: this copy stays
        uncached and is reused as a plain block when freed."""
        for block, block_hash in zip(blocks[start:end], block_hashes[start:end]):
            if block.block_hash is None and block_hash not in self.cached_block_hash_to_block:
                block.block_hash = block_hash
                self.cached_block_hash_to_block[block_hash] = block

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            del self.cached_block_hash_to_block[block.block_hash]
            block.block_hash = None
            self.num_evictions += 1

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (benchmarks start cold with it). Only when no block is in
        use: a running request's blocks must keep their content."""
        if self.get_num_free_blocks() != self.num_blocks - 1:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        return True

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one holder from each block; a block nobody holds goes to the back of the free
        queue, so the order given here is the order in which they will be reused. A cached block
        keeps its hash there: it can still be hit until it is reused."""
        for block in ordered_blocks:
            if block.is_null:
                continue
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} freed more times than allocated")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of the usable blocks (all but the null block) in use, 0.0 to 1.0."""
        usable = self.num_blocks - 1
        return 1.0 - self.get_num_free_blocks() / usable
