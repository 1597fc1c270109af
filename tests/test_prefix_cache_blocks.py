"""Part 07 bookkeeping without a model: chained block hashes, the cache in the BlockPool
(hash map, reference counts, lazy LRU eviction), the KVCacheManager's lookup and counters, and
the scheduler starting a sequence after its cache hit (with chunking, preemption and a token in
flight)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from part07_prefix_cache.block_pool import BlockPool
from part07_prefix_cache.kv_cache_manager import KVCacheManager
from part07_prefix_cache.kv_cache_utils import BlockHasher, hash_block_tokens, make_none_hash
from part07_prefix_cache.request import Sequence
from part07_prefix_cache.scheduler import Scheduler, SchedulerConfig
from sched_fakes import State, arrive, make_seq, names
from shared.sampling_params import SamplingParams

BS = 4


def seq(name: str, tokens: list[int], salt: str | None = None, n_preempt: int = 0) -> Sequence:
    request = SimpleNamespace(params=SamplingParams(max_tokens=50), cache_salt=salt)
    return Sequence(name, request=request, state=State(), token_ids=list(tokens), num_preemptions=n_preempt)


def held(kv: KVCacheManager, s: Sequence) -> list[int]:
    return kv.get_block_ids(s.seq_id)


def admit(kv: KVCacheManager, s: Sequence) -> int:
    """What the scheduler does on a sequence's first step: hit, then allocate the rest."""
    blocks, num_hit = kv.get_computed_blocks(s)
    assert kv.allocate_slots(s, s.num_tokens, blocks)
    s.num_computed_tokens = s.num_tokens
    return num_hit


# -- hashes ---------------------------------------------------------------------------------

def test_hash_chains_over_the_parent_and_covers_tokens_and_extra_keys():
    root = make_none_hash("seed")
    h = hash_block_tokens(root, [1, 2, 3, 4])
    assert h == hash_block_tokens(root, [1, 2, 3, 4]) and len(h) == 32
    assert h != hash_block_tokens(root, [1, 2, 3, 5])
    assert h != hash_block_tokens(make_none_hash("other"), [1, 2, 3, 4])  # same tokens, other prefix
    assert h != hash_block_tokens(root, [1, 2, 3, 4], ("salt", "a"))
    # Canonical encoding: no two token lists share an encoding (fixed-width ids, a length prefix).
    assert hash_block_tokens(root, [1, 2]) != hash_block_tokens(root, [1, 2, 0])
    assert hash_block_tokens(root, [256]) != hash_block_tokens(root, [1, 0])


def test_a_fixed_seed_gives_every_process_the_same_hashes_and_no_seed_a_private_root():
    assert make_none_hash("s") == make_none_hash("s") != make_none_hash("t")
    assert make_none_hash(None) != make_none_hash(None)  # os.urandom: nobody can precompute them
    a, b = seq("a", range(10)), seq("b", range(10))
    BlockHasher(BS, make_none_hash("s")).hash_new_full_blocks(a)
    BlockHasher(BS, make_none_hash("s")).hash_new_full_blocks(b)  # "another process"
    assert a.block_hashes == b.block_hashes and len(a.block_hashes) == 2  # full blocks only


def test_hashes_grow_as_blocks_fill_and_chain_from_the_previous_block():
    hasher = BlockHasher(BS, make_none_hash("s"))
    s = seq("s", range(7))
    hasher.hash_new_full_blocks(s)
    assert len(s.block_hashes) == 1
    first = list(s.block_hashes)
    s.token_ids.append(7)  # block 1 is now full
    hasher.hash_new_full_blocks(s)
    assert s.block_hashes[:1] == first and len(s.block_hashes) == 2
    assert s.block_hashes[1] == hash_block_tokens(s.block_hashes[0], [4, 5, 6, 7])


def test_cache_salt_enters_the_first_block_so_salted_chains_never_meet():
    hasher = BlockHasher(BS, make_none_hash("s"))
    plain, a, a2, b = seq("p", range(12)), seq("a", range(12), "A"), seq("a2", range(12), "A"), seq("b", range(12), "B")
    for s in (plain, a, a2, b):
        hasher.hash_new_full_blocks(s)
    assert a.block_hashes == a2.block_hashes
    for x, y in [(plain, a), (a, b), (plain, b)]:
        assert not set(x.block_hashes) & set(y.block_hashes)  # no block in common, not even later ones


# -- the block pool as a cache --------------------------------------------------------------

def test_freed_cached_blocks_stay_hittable_until_reused_then_are_evicted_lru():
    pool = BlockPool(5)  # 4 usable
    blocks = pool.get_new_blocks(2)
    hashes = [b"h0" * 16, b"h1" * 16]
    pool.cache_full_blocks(blocks, hashes, 0, 2)
    pool.free_blocks(reversed(blocks))  # tail first
    assert pool.get_cached_block(hashes[0]) is blocks[0]  # still cached while free
    # The never-used blocks are reused first, then the freed ones in the order they were freed:
    # tail (h1) before head (h0).
    fresh = pool.get_new_blocks(2)
    assert pool.get_cached_block(hashes[1]) is blocks[1] and not {b.block_id for b in fresh} & {1, 2}
    pool.get_new_blocks(1)
    assert pool.get_cached_block(hashes[1]) is None and blocks[1].block_hash is None  # evicted
    assert pool.get_cached_block(hashes[0]) is blocks[0] and pool.num_evictions == 1
    pool.get_new_blocks(1)
    assert pool.get_cached_block(hashes[0]) is None and not pool.cached_block_hash_to_block


def test_a_hit_on_a_free_cached_block_takes_it_out_of_the_free_queue():
    pool = BlockPool(4)
    [block] = pool.get_new_blocks(1)
    pool.cache_full_blocks([block], [b"x" * 32], 0, 1)
    pool.free_blocks([block])
    assert pool.get_num_free_blocks() == 3
    pool.touch([block])
    assert block.ref_cnt == 1 and pool.get_num_free_blocks() == 2
    assert block not in pool.free_block_queue.get_all_free_blocks()
    assert {b.block_id for b in pool.get_new_blocks(2)}.isdisjoint({block.block_id})
    pool.touch([block])  # a second holder: shared, no queue involved
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    pool.free_blocks([block])
    assert block.ref_cnt == 0 and pool.get_cached_block(b"x" * 32) is block
    with pytest.raises(RuntimeError):
        pool.free_blocks([block])  # never below zero


def test_a_hash_already_cached_keeps_its_first_block():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [b"same" * 8], 0, 1)
    pool.cache_full_blocks([b], [b"same" * 8], 0, 1)
    assert pool.get_cached_block(b"same" * 8) is a and b.block_hash is None


def test_reset_prefix_cache_only_when_nothing_is_in_use():
    pool = BlockPool(4)
    [block] = pool.get_new_blocks(1)
    pool.cache_full_blocks([block], [b"y" * 32], 0, 1)
    assert not pool.reset_prefix_cache()
    pool.free_blocks([block])
    assert pool.reset_prefix_cache() and pool.get_cached_block(b"y" * 32) is None


# -- the manager: lookup, sharing, counters --------------------------------------------------

def test_second_identical_prompt_hits_all_but_its_last_partial_block():
    kv = KVCacheManager(20, BS, hash_seed="t")
    a, b = seq("a", range(10)), seq("b", range(10))
    assert admit(kv, a) == 0
    assert admit(kv, b) == 8  # two full blocks found, 2 tokens to compute
    assert held(kv, a)[:2] == held(kv, b)[:2] and held(kv, a)[2] != held(kv, b)[2]
    pool = kv.block_pool
    assert [pool.blocks[i].ref_cnt for i in held(kv, a)] == [2, 2, 1]
    st = kv.prefix_cache_stats
    assert (st.requests, st.queries, st.hits) == (2, 20, 8) and st.hit_rate == 0.4


def test_a_prompt_entirely_in_the_cache_recomputes_its_last_block():
    kv = KVCacheManager(20, BS, hash_seed="t")
    a, b = seq("a", range(12)), seq("b", range(12))  # an exact multiple of the block size
    admit(kv, a)
    assert admit(kv, b) == 8  # not 12: the last token must run through the model for its logits
    assert held(kv, b)[:2] == held(kv, a)[:2] and held(kv, b)[2] != held(kv, a)[2]
    # b's own copy of block 2 is not entered in the map over a's.
    assert kv.block_pool.get_cached_block(a.block_hashes[2]).block_id == held(kv, a)[2]


def test_refcounts_are_zero_at_rest_and_the_cache_survives_the_requests():
    kv = KVCacheManager(20, BS, hash_seed="t")
    seqs = [seq(str(i), [*range(9), i]) for i in range(4)]
    for s in seqs:
        admit(kv, s)
    for s in seqs:
        kv.free(s.seq_id)
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks) and kv.num_free_blocks == 19
    assert admit(kv, seq("late", [*range(9), 99])) == 8


def test_allocation_failure_takes_no_hit_and_changes_nothing():
    kv = KVCacheManager(5, BS, hash_seed="t")  # 4 usable blocks
    a = seq("a", range(9))
    admit(kv, a)  # 3 blocks
    kv.free(a.seq_id)  # all free again, 2 of them cached
    hog = seq("hog", [50, 51, 52, 53])
    admit(kv, hog)  # takes the never-used block: a's three are left, two of them cached
    b = seq("b", [*range(8), 7, 7, 7, 7, 7])  # hits 2 blocks, needs 2 more: only 2 free, both hit
    blocks, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8
    free_before = kv.num_free_blocks
    assert not kv.allocate_slots(b, b.num_tokens, blocks)
    assert kv.num_free_blocks == free_before and all(x.ref_cnt == 0 for x in blocks)
    assert b.seq_id not in kv.req_to_blocks and kv.prefix_cache_stats.requests == 2


def test_caching_off_finds_nothing_and_counts_nothing():
    kv = KVCacheManager(20, BS, enable_caching=False)
    a, b = seq("a", range(10)), seq("b", range(10))
    assert admit(kv, a) == 0 and admit(kv, b) == 0
    assert not kv.block_pool.cached_block_hash_to_block and kv.prefix_cache_stats.queries == 0


def test_salted_requests_share_nothing():
    kv = KVCacheManager(20, BS, hash_seed="t")
    admit(kv, seq("a", range(10), salt="tenant-a"))
    assert admit(kv, seq("b", range(10), salt="tenant-b")) == 0
    assert admit(kv, seq("c", range(10))) == 0
    assert admit(kv, seq("a2", range(10), salt="tenant-a")) == 8


# -- the scheduler -----------------------------------------------------------------------------

def make_sched(num_blocks=40, budget=64, seats=8, **kw):
    kv = KVCacheManager(num_blocks, BS, hash_seed="t")
    return Scheduler(SchedulerConfig(seats, budget, max_model_len=256, **kw), kv), kv


def finish_all(sched, out):
    for s, _ in out.scheduled:
        if s.num_output_placeholders:
            arrive(s)


def test_a_hit_costs_no_budget_and_the_rest_is_chunked():
    sched, kv = make_sched(budget=6)
    first = make_seq(Sequence, "first", 10)
    sched.add(first)
    steps = []
    while first.num_output_placeholders == 0:
        out = sched.schedule()
        steps.append(names(out))
    assert steps == [[("first", 6)], [("first", 4)]]
    arrive(first)
    second = make_seq(Sequence, "second", 22)  # tokens 0..21: its first 8 are first's
    sched.add(second)
    out = sched.schedule()
    assert names(out) == [("first", 1), ("second", 5)]  # decode first; second starts at 8
    assert second.num_computed_tokens == 13 and not out.samples[1]
    assert kv.prefix_cache_stats.hits == 8


def test_siblings_scheduled_together_share_the_prompt_blocks():
    sched, kv = make_sched()
    request = SimpleNamespace(params=SamplingParams(max_tokens=5, n=2), cache_salt=None)
    a, b = (Sequence(f"r-{i}", request=request, state=State(), token_ids=list(range(9))) for i in range(2))
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert names(out) == [("r-0", 9), ("r-1", 1)]  # the second hits the first's two full blocks
    assert held(kv, a)[:2] == held(kv, b)[:2]


def test_a_block_full_of_placeholder_is_hashed_only_once_its_token_arrives():
    sched, kv = make_sched()
    s = make_seq(Sequence, "s", 7)
    sched.add(s)
    sched.schedule()  # prompt: 7 tokens, block 0 full and cached; the token in flight is token 7
    out = sched.schedule()  # decode of token 7 launched before its id is known: block 1 is full...
    assert names(out) == [("s", 1)] and s.num_computed_tokens == 8
    assert len(s.block_hashes) == 1 and len(kv.block_pool.cached_block_hash_to_block) == 1  # ...not hashed
    arrive(s, 70)
    arrive(s, 71)
    sched.schedule()
    assert len(s.block_hashes) == 2 and s.block_hashes[1] == hash_block_tokens(s.block_hashes[0], [4, 5, 6, 70])
    assert kv.block_pool.get_cached_block(s.block_hashes[1]).block_id == held(kv, s)[1]


def test_a_preempted_sequence_re_hits_its_own_blocks_and_is_not_counted_as_a_hit():
    sched, kv = make_sched(num_blocks=6, budget=64, seats=4)  # 5 usable blocks
    a = make_seq(Sequence, "a", 8)
    b = make_seq(Sequence, "b", 9)
    b.token_ids = [100 + t for t in b.token_ids]  # nothing in common with a
    sched.add(a)
    sched.add(b)
    out = sched.schedule()  # a: 2 blocks, b: 3 blocks
    finish_all(sched, out)
    assert kv.num_free_blocks == 0
    out = sched.schedule()  # a needs a 3rd block to decode: b (newest) is preempted
    assert [s.seq_id for s in out.preempted] == ["b"]
    finish_all(sched, out)
    sched.finish(a)  # a done: room again
    a.state.finished = True
    out = sched.schedule()
    assert names(out) == [("b", 2)]  # b's first two full blocks were still cached
    st = kv.prefix_cache_stats
    assert (st.requests, st.hits) == (2, 0) and (st.preempted_requests, st.preempted_hits) == (1, 8)
