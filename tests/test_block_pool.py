"""Part 03 block bookkeeping: the free block queue, the BlockPool and the KVCacheManager.
Plain Python, no model and no tensors."""
from __future__ import annotations

import pytest
import torch

from part03_paged_attention.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from part03_paged_attention.kv_cache_manager import (KVCacheManager, compute_slot_mapping,
                                                     num_blocks_for_budget)


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


# -- FreeKVCacheBlockQueue ---------------------------------------------------------------------

def test_free_queue_is_fifo():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    assert len(queue) == 5 and ids(queue.get_all_free_blocks()) == [0, 1, 2, 3, 4]
    assert queue.popleft().block_id == 0
    assert ids(queue.popleft_n(2)) == [1, 2]
    queue.append(blocks[1])
    queue.append(blocks[0])
    assert ids(queue.get_all_free_blocks()) == [3, 4, 1, 0]
    assert ids(queue.popleft_n(4)) == [3, 4, 1, 0]
    assert len(queue) == 0
    with pytest.raises(ValueError):
        queue.popleft()


def test_free_queue_remove_from_middle_and_ends():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[2])
    assert ids(queue.get_all_free_blocks()) == [0, 1, 3, 4] and len(queue) == 4
    assert blocks[2].prev_free_block is None and blocks[2].next_free_block is None
    queue.remove(blocks[0])
    queue.remove(blocks[4])
    assert ids(queue.get_all_free_blocks()) == [1, 3]
    with pytest.raises(RuntimeError):
        queue.remove(blocks[2])  # not in the queue any more
    queue.append(blocks[2])
    assert ids(queue.get_all_free_blocks()) == [1, 3, 2]
    assert queue.popleft().block_id == 1


def test_free_queue_popleft_n_too_many_takes_nothing():
    queue = FreeKVCacheBlockQueue([KVCacheBlock(i) for i in range(3)])
    with pytest.raises(ValueError):
        queue.popleft_n(4)
    assert len(queue) == 3


def test_block_repr_does_not_walk_the_chain():
    blocks = [KVCacheBlock(i) for i in range(3)]
    FreeKVCacheBlockQueue(blocks)
    assert "prev_free_block" not in repr(blocks[1])


# -- BlockPool -----------------------------------------------------------------------------------

def test_pool_reserves_the_null_block():
    pool = BlockPool(8)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.get_num_free_blocks() == 7
    handed_out = pool.get_new_blocks(7)
    assert 0 not in ids(handed_out)
    assert pool.get_num_free_blocks() == 0 and pool.get_usage() == 1.0


def test_pool_allocate_and_free_accounting():
    pool = BlockPool(10)
    a = pool.get_new_blocks(3)
    b = pool.get_new_blocks(2)
    assert ids(a) == [1, 2, 3] and ids(b) == [4, 5]
    assert all(block.ref_cnt == 1 for block in a + b)
    assert pool.get_num_free_blocks() == 4
    assert pool.get_usage() == pytest.approx(5 / 9)
    pool.free_blocks(a)
    assert all(block.ref_cnt == 0 for block in a)
    assert pool.get_num_free_blocks() == 7
    # Freed blocks go to the back: the never-used ones come out first, then a in freeing order.
    assert ids(pool.get_new_blocks(7)) == [6, 7, 8, 9, 1, 2, 3]
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)


def test_pool_shared_block_returns_only_at_zero_refs():
    pool = BlockPool(4)
    (block,) = pool.get_new_blocks(1)
    block.ref_cnt += 1  # a second holder (what part 07's prefix cache does)
    pool.free_blocks([block])
    assert block.ref_cnt == 1 and pool.get_num_free_blocks() == 2
    pool.free_blocks([block])
    assert block.ref_cnt == 0 and pool.get_num_free_blocks() == 3
    with pytest.raises(RuntimeError):
        pool.free_blocks([block])  # double free


def test_pool_get_new_blocks_too_many_raises_and_takes_nothing():
    pool = BlockPool(4)
    with pytest.raises(ValueError):
        pool.get_new_blocks(4)
    assert pool.get_num_free_blocks() == 3


# -- KVCacheManager --------------------------------------------------------------------------------

def test_allocate_slots_grows_block_by_block():
    mgr = KVCacheManager(num_blocks=10, block_size=4)
    assert mgr.allocate_slots("r", 5)  # prompt of 5 tokens: 2 blocks
    assert len(mgr.get_block_ids("r")) == 2 and mgr.num_free_blocks == 7
    for total in (6, 7, 8):  # fills the second block: nothing new
        assert mgr.allocate_slots("r", total)
        assert len(mgr.get_block_ids("r")) == 2
    assert mgr.allocate_slots("r", 9)  # token 9 starts block 3
    assert len(mgr.get_block_ids("r")) == 3 and mgr.num_free_blocks == 6
    assert mgr.allocate_slots("r", 2)  # never shrinks
    assert len(mgr.get_block_ids("r")) == 3


def test_exact_multiple_needs_no_block_until_next_token():
    mgr = KVCacheManager(num_blocks=10, block_size=4)
    assert mgr.allocate_slots("r", 8)
    assert len(mgr.get_block_ids("r")) == 2
    assert mgr.allocate_slots("r", 8)
    assert len(mgr.get_block_ids("r")) == 2
    assert mgr.allocate_slots("r", 9)
    assert len(mgr.get_block_ids("r")) == 3


def test_allocate_slots_returns_false_when_full_and_changes_nothing():
    mgr = KVCacheManager(num_blocks=5, block_size=4)  # 4 usable blocks
    assert mgr.allocate_slots("a", 12)  # 3 blocks
    before = (mgr.num_free_blocks, mgr.get_block_ids("a"))
    assert not mgr.allocate_slots("b", 8)  # needs 2, 1 free
    assert not mgr.allocate_slots("a", 20)  # needs 2 more, 1 free
    assert (mgr.num_free_blocks, mgr.get_block_ids("a")) == before
    assert mgr.get_block_ids("b") == [] and "b" not in mgr.req_to_blocks
    assert mgr.allocate_slots("b", 4)  # exactly the last block
    assert mgr.num_free_blocks == 0 and mgr.usage == 1.0
    assert not mgr.allocate_slots("a", 13)


def test_pool_is_full_again_after_freeing_everything():
    mgr = KVCacheManager(num_blocks=17, block_size=4)
    for step, total in enumerate([1, 3, 4, 5, 9, 16, 17]):
        for r in range(3):
            assert mgr.allocate_slots(f"r{r}", total + r)
        if step == 3:
            mgr.free("r1")
    in_use = [b for r in range(3) for b in mgr.get_block_ids(f"r{r}")]
    assert len(in_use) == len(set(in_use)) and 0 not in in_use  # no block owned twice
    for r in range(3):
        mgr.free(f"r{r}")
    mgr.free("never-seen")  # harmless
    assert mgr.num_free_blocks == 16 and mgr.usage == 0.0 and not mgr.req_to_blocks
    assert all(block.ref_cnt == 0 for block in mgr.block_pool.blocks)


def test_free_returns_tail_block_first():
    mgr = KVCacheManager(num_blocks=4, block_size=2)
    mgr.allocate_slots("r", 6)
    assert mgr.get_block_ids("r") == [1, 2, 3]
    mgr.free("r")
    assert ids(mgr.block_pool.free_block_queue.get_all_free_blocks()) == [3, 2, 1]


def test_slot_mapping():
    assert compute_slot_mapping([7, 2, 5], 4, 0, 10) == [28, 29, 30, 31, 8, 9, 10, 11, 20, 21]
    assert compute_slot_mapping([7, 2, 5], 4, 6, 9) == [10, 11, 20]
    assert compute_slot_mapping([7, 2, 5], 4, 3, 3) == []
    mgr = KVCacheManager(num_blocks=10, block_size=4)
    mgr.allocate_slots("a", 3)
    mgr.allocate_slots("b", 3)
    mgr.allocate_slots("a", 6)  # a: blocks [1, 3]; b: [2]
    assert mgr.get_block_ids("a") == [1, 3]
    assert mgr.get_slot_mapping("a", 0, 6) == [4, 5, 6, 7, 12, 13]
    assert mgr.get_slot_mapping("a", 5, 6) == [13]  # the decode token
    assert mgr.get_slot_mapping("b", 0, 3) == [8, 9, 10]
    with pytest.raises(ValueError):
        mgr.get_slot_mapping("b", 3, 5)  # position 4 has no block yet


def test_slot_mapping_covers_each_slot_once():
    mgr = KVCacheManager(num_blocks=9, block_size=4)
    for r, n in enumerate([5, 11, 8, 1]):
        assert mgr.allocate_slots(str(r), n)
    slots = [s for r, n in enumerate([5, 11, 8, 1]) for s in mgr.get_slot_mapping(str(r), 0, n)]
    assert len(slots) == len(set(slots)) == 25
    assert min(slots) >= 4 and max(slots) < 9 * 4  # never the null block's slots 0..3


def test_num_blocks_for_budget():
    # SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64, block_size 16, fp32:
    # K and V * 30 layers * 16 tokens * 3 heads * 64 dims * 4 bytes = 737,280 bytes per block.
    per_block = 2 * 30 * 16 * 3 * 64 * 4
    assert num_blocks_for_budget(per_block * 100, 30, 3, 64, 16, torch.float32) == 100
    assert num_blocks_for_budget(per_block * 100 - 1, 30, 3, 64, 16, torch.float32) == 99
    assert num_blocks_for_budget(per_block * 100, 30, 3, 64, 16, torch.bfloat16) == 200
    assert num_blocks_for_budget(2 ** 30, 30, 3, 64, 16, torch.float32) == 1456
    assert num_blocks_for_budget(per_block - 1, 30, 3, 64, 16, torch.float32) == 0
