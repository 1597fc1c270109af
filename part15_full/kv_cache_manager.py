"""Which blocks each request owns: the request -> block list map on top of the BlockPool.

A request's block list is its *block table*: logical block i (token positions
i*block_size .. (i+1)*block_size-1) lives in physical block block_ids[i]. Blocks are added one at
a time as the request grows, so a request never holds more than one partly filled block, and
memory is committed only for tokens that exist (the contiguous cache of part 01 reserved
prompt + max_tokens up front).

Prefix caching (part 07): before a sequence's first step, `get_computed_blocks` finds the longest
run of its leading full blocks already in the pool's cache; the sequence takes those blocks as
they are (their K/V are already computed) and starts computing after them. As a sequence's steps
fill blocks, `allocate_slots` enters them in the cache for the requests that come after it."""
from __future__ import annotations

from dataclasses import dataclass

from .block_pool import BlockPool, KVCacheBlock
from .block_utils import cdiv, compute_slot_mapping
from .kv_cache_utils import BlockHasher, make_none_hash


@dataclass
class PrefixCacheStats:
    """vLLM's counters, in tokens. A sequence counts once, at its first step. A preempted one
    that finds its own freed blocks again counts apart: that is recomputation saved, not a hit
    a user would see."""
    requests: int = 0
    queries: int = 0  # tokens looked up (the sequence's length at its first step)
    hits: int = 0  # of those, found in the cache
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 hash_seed: str | None = None):
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.enable_caching = enable_caching
        self.block_hasher = BlockHasher(block_size, make_none_hash(hash_seed))
        self.num_cached_blocks: dict[str, int] = {}  # seq_id -> its leading blocks in the cache
        self.prefix_cache_stats = PrefixCacheStats()

    def get_computed_blocks(self, seq) -> tuple[list[KVCacheBlock], int]:
        """The longest run of the sequence's leading full blocks found in the cache, and how
        many tokens they hold. At least one token is always left to compute: the step must run
        the model on the last token to get its logits. A hit is whole blocks, so a sequence
        found whole in the cache (a length that is a multiple of the block size) recomputes its
        last block in a block of its own, never writing into a shared one."""
        if not self.enable_caching:
            return [], 0
        self.block_hasher.hash_new_full_blocks(seq)
        blocks = []
        for block_hash in seq.block_hashes[:(seq.num_tokens - 1) // self.block_size]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def allocate_slots(self, seq, num_tokens: int, new_computed_blocks: list[KVCacheBlock] = (),
                       cache: bool = True) -> bool:
        """Make sure the sequence owns blocks for `num_tokens` tokens in total (tokens already
        cached plus the ones about to be computed), starting, on its first step, with the cache
        hit `new_computed_blocks`. Returns False, allocating nothing, when the pool cannot supply
        the missing blocks: the scheduler then waits or preempts. `cache=False` (part 12): the
        blocks are about to be filled by a copy from host memory, not by a step, so they enter the
        prefix cache only on the sequence's next allocation, after the copy is done."""
        blocks = self.req_to_blocks.get(seq.seq_id, [])
        num_new = cdiv(num_tokens, self.block_size) - len(blocks) - len(new_computed_blocks)
        # A hit on a block nobody holds takes it out of the free queue: it costs a free block too.
        num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if max(num_new, 0) + num_revived > self.block_pool.get_num_free_blocks():
            return False
        if seq.seq_id not in self.req_to_blocks:
            self.req_to_blocks[seq.seq_id] = blocks
            self._record_lookup(seq, len(new_computed_blocks) * self.block_size)
        self.block_pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        if num_new > 0:
            blocks.extend(self.block_pool.get_new_blocks(num_new))
        if self.enable_caching and cache:
            self._cache_blocks(seq, num_tokens)
        return True

    def _cache_blocks(self, seq, num_tokens: int) -> None:
        """Enter the sequence's blocks that will be full of computed tokens once this step runs
        and whose tokens are all known (so hashed): a later sequence may hit them from the next
        step on, or even in this one, since each layer writes the step's K/V before it reads."""
        self.block_hasher.hash_new_full_blocks(seq)
        start = self.num_cached_blocks.get(seq.seq_id, 0)
        end = min(num_tokens // self.block_size, len(seq.block_hashes))
        if end > start:
            self.block_pool.cache_full_blocks(self.req_to_blocks[seq.seq_id], seq.block_hashes, start, end)
            self.num_cached_blocks[seq.seq_id] = end

    def _record_lookup(self, seq, num_hit_tokens: int) -> None:
        if not self.enable_caching:
            return
        stats = self.prefix_cache_stats
        if seq.num_preemptions:
            stats.preempted_requests += 1
            stats.preempted_queries += seq.num_tokens
            stats.preempted_hits += num_hit_tokens
        else:
            stats.requests += 1
            stats.queries += seq.num_tokens
            stats.hits += num_hit_tokens

    def free(self, request_id: str) -> None:
        """Return every block of the request to the pool (a no-op for an unknown request)."""
        blocks = self.req_to_blocks.pop(request_id, [])
        self.num_cached_blocks.pop(request_id, None)
        # Tail first: the tail block then sits nearer the front of the free queue and is
        # evicted before the head. The head of a prompt is what other requests share (a system
        # prompt), so it is the part worth keeping longest.
        self.block_pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

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
