"""Unit tests of the host tier's eviction policies (cache_policy.py), model-free."""
import pytest

from part12_offload.cache_policy import ARCCachePolicy, BlockStatus, LRUCachePolicy, make_cache_policy


def k(i: int) -> bytes:
    return b"key-%d" % i


def ready(policy, keys, first_id=0):
    for n, key in enumerate(keys):
        policy.insert(key, BlockStatus(first_id + n, ref_cnt=0))


def snapshot(policy):
    state = [(key, b.block_id, b.ref_cnt) for key, b in policy.items()]
    if isinstance(policy, ARCCachePolicy):
        state += [list(policy.b1), list(policy.b2), policy.target_t1_size]
    return state


def test_make_cache_policy():
    assert type(make_cache_policy("lru", 4)) is LRUCachePolicy
    assert type(make_cache_policy("arc", 4)) is ARCCachePolicy
    with pytest.raises(ValueError, match="unknown eviction policy 'fifo'"):
        make_cache_policy("fifo", 4)


def test_lru_evicts_least_recent_and_touch_puts_a_prefix_head_last():
    p = LRUCachePolicy(8)
    ready(p, [k(0), k(1), k(2), k(3)])
    p.touch([k(0), k(1)])  # a request reads the prefix 0, 1: block 0 must end most recent
    assert [key for key, _ in p.items()] == [k(2), k(3), k(1), k(0)]
    assert [key for key, _ in p.evict(3, set())] == [k(2), k(3), k(1)]
    assert [key for key, _ in p.items()] == [k(0)]


@pytest.mark.parametrize("name", ["lru", "arc"])
def test_evict_skips_pinned_pending_and_protected(name):
    p = make_cache_policy(name, 8)
    ready(p, [k(0), k(1), k(2), k(3)])
    p.get(k(0)).ref_cnt = 2  # pinned by two loads
    p.insert(k(9), BlockStatus(9))  # being stored (ref_cnt -1)
    evicted = p.evict(2, protected={k(1)})
    assert [key for key, _ in evicted] == [k(2), k(3)]
    assert [b.block_id for _, b in evicted] == [2, 3]
    assert p.get(k(2)) is None and p.get(k(0)) is not None and p.get(k(9)) is not None


@pytest.mark.parametrize("name", ["lru", "arc"])
def test_evict_is_atomic(name):
    p = make_cache_policy(name, 8)
    ready(p, [k(0), k(1), k(2)])
    p.touch([k(1)])  # ARC: k(1) moves to T2, so both lists hold candidates
    p.get(k(2)).ref_cnt = 1
    before = snapshot(p)
    assert p.evict(3, set()) is None  # only 2 idle blocks
    assert snapshot(p) == before
    assert p.evict(0, set()) == [] and snapshot(p) == before


def test_arc_promotes_on_second_use_but_not_while_being_stored():
    p = ARCCachePolicy(8)
    ready(p, [k(0)])
    p.insert(k(1), BlockStatus(1))  # still being stored
    p.touch([k(0), k(1)])
    assert list(p.t2) == [k(0)] and list(p.t1) == [k(1)]


def test_arc_ghost_hits_move_the_t1_target():
    p = ARCCachePolicy(4)
    ready(p, [k(0), k(1), k(2)])
    p.touch([k(2)])  # T1 = [0, 1], T2 = [2]
    assert [key for key, _ in p.evict(1, set())] == [k(0)]  # T1 above target 0: T1 gives
    assert list(p.b1) == [k(0)]
    p.touch([k(0)])
    assert p.target_t1_size == 1.0  # B1 hit, |B2| = 0: step max(1, 0) = 1
    p.target_t1_size = 4.0  # now T1 (size 1) is below target: T2 gives
    assert [key for key, _ in p.evict(1, set())] == [k(2)]
    assert list(p.b2) == [k(2)]
    p.touch([k(2)])
    assert p.target_t1_size == 3.0  # B2 hit: step max(1, |B1| / |B2|) = max(1, 1 / 1) = 1


def test_arc_ghost_reinsert_goes_to_t2_and_leaves_the_ghost_list():
    p = ARCCachePolicy(4)
    ready(p, [k(0), k(1)])
    p.evict(1, set())
    assert list(p.b1) == [k(0)]
    p.insert(k(0), BlockStatus(7))
    assert list(p.t2) == [k(0)] and list(p.t1) == [k(1)] and not p.b1


def test_arc_falls_back_to_t1_when_t2_is_all_pinned():
    p = ARCCachePolicy(4)
    ready(p, [k(0), k(1)])
    p.touch([k(1)])  # T1 = [0], T2 = [1]
    p.get(k(1)).ref_cnt = 1
    p.target_t1_size = 4.0  # would prefer evicting from T2
    assert [key for key, _ in p.evict(1, set())] == [k(0)]


def test_arc_ghost_lists_are_bounded_by_capacity():
    cap = 3
    p = ARCCachePolicy(cap)
    for i in range(20):  # every block through T1 into B1
        ready(p, [k(i)], first_id=i)
        p.evict(1, set())
    for i in range(100, 120):  # every block through T2 into B2
        ready(p, [k(i)], first_id=i)
        p.touch([k(i)])
        p.evict(1, set())
    assert list(p.b1) == [k(17), k(18), k(19)]  # the most recent ghosts are kept
    assert list(p.b2) == [k(117), k(118), k(119)]


@pytest.mark.parametrize("name", ["lru", "arc"])
def test_clear_and_remove(name):
    p = make_cache_policy(name, 4)
    ready(p, [k(0), k(1), k(2)])
    p.evict(1, set())
    p.touch([k(0)])
    p.remove(k(1))
    assert p.get(k(1)) is None and len(p) == 1
    p.clear()
    assert len(p) == 0 and snapshot(p) in ([], [[], [], 0.0])
