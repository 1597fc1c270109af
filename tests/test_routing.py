"""Part 10's request router (part10_dp/router.py): model-free, with real chained block hashes."""
from __future__ import annotations

import hashlib
import random
from collections import Counter

import pytest

from part10_dp.router import (ROUTING_POLICIES, CacheAwareRouter, EngineLoad, LeastLoadedRouter,
                              RoundRobinRouter, make_router)

BLOCK_SIZE = 4


def chain_hashes(token_ids: list[int], block_size: int = BLOCK_SIZE) -> list[bytes]:
    """Hashes of the full blocks of `token_ids`, each covering its parent's hash (a chain)."""
    hashes, parent = [], b"test-root"
    for i in range(len(token_ids) // block_size):
        block = token_ids[i * block_size:(i + 1) * block_size]
        parent = hashlib.sha256(parent + b"".join(t.to_bytes(4, "little") for t in block)).digest()
        hashes.append(parent)
    return hashes


def toks(start: int, num_blocks: int) -> list[int]:
    return list(range(start, start + num_blocks * BLOCK_SIZE))


def running(*counts: int) -> list[EngineLoad]:
    return [EngineLoad(running=c) for c in counts]


SYSTEM = toks(1000, 3)  # a 3-block shared prefix
REQ_X = chain_hashes(SYSTEM + toks(5000, 1))
REQ_Y = chain_hashes(SYSTEM + toks(6000, 1))
REQ_Z = chain_hashes(SYSTEM + toks(7000, 1))
OTHER = chain_hashes(toks(9000, 4))


def test_chain_hashes_depend_on_prefix():
    a = chain_hashes(toks(0, 1) + toks(100, 1))
    b = chain_hashes(toks(50, 1) + toks(100, 1))
    assert a[1] != b[1]  # same block tokens, different parent
    assert REQ_X[:3] == REQ_Y[:3] and REQ_X[3] != REQ_Y[3]


def test_load_score_weights_waiting():
    assert EngineLoad(waiting=1).score == 4 and EngineLoad(running=3).score == 3


def test_round_robin_cycles_and_skips_forgotten():
    r = RoundRobinRouter(3)
    loads = running(0, 0, 0)
    assert [r.route(OTHER, loads) for _ in range(4)] == [0, 1, 2, 0]
    r.forget(1)
    assert [r.route(OTHER, loads) for _ in range(4)] == [2, 0, 2, 0]


def test_least_loaded_weights_waiting_over_running():
    r = LeastLoadedRouter(2)
    assert r.route(OTHER, [EngineLoad(waiting=1, running=0), EngineLoad(waiting=0, running=3)]) == 1
    assert r.route(OTHER, [EngineLoad(waiting=0, running=3), EngineLoad(waiting=1, running=0)]) == 0


def test_least_loaded_spreads_ties():
    r = LeastLoadedRouter(4)
    assert sorted(r.route(OTHER, running(0, 0, 0, 0)) for _ in range(4)) == [0, 1, 2, 3]
    assert r.route(OTHER, running(1, 0, 1, 1)) == 1  # a strict minimum still wins


def test_cache_aware_sends_shared_prefix_to_same_engine():
    r = CacheAwareRouter(4)
    assert r.route(REQ_X, running(5, 5, 0, 5)) == 2  # nothing cached yet: least loaded
    # 3 of 4 blocks cached on engine 2, which is now the busiest (but not imbalanced).
    assert r.route(REQ_Y, running(0, 0, 6, 0)) == 2


def test_cache_aware_routes_new_prefix_by_load():
    r = CacheAwareRouter(4)
    r.route(REQ_X, running(5, 5, 0, 5))
    assert r.route(OTHER, running(3, 1, 6, 2)) == 1
    assert r.route([], running(3, 2, 1, 6)) == 2  # no full block: least loaded


def test_cache_aware_new_prefix_tie_prefers_emptier_cache():
    r = CacheAwareRouter(3)
    assert r.route(REQ_X, running(0, 1, 1)) == 0
    assert r.route(OTHER, running(0, 0, 0)) == 1  # engines 1 and 2 remember nothing


def test_cache_aware_longest_match_then_lower_score():
    r = CacheAwareRouter(2)
    assert r.route(REQ_X, running(0, 100)) == 0
    assert r.route(REQ_Y, running(100, 0)) == 1  # imbalanced: least loaded, now both know SYSTEM
    assert r.route(REQ_Z, running(5, 3)) == 1  # equal match (3 blocks): lower score
    assert r.route(REQ_Z, running(3, 5)) == 1  # engine 1 now matches all 4 blocks
    assert r.route(REQ_X, running(9, 0)) == 0  # engine 0 matches REQ_X fully, engine 1 only 3


@pytest.mark.parametrize("loads, expected", [
    (running(100, 10), 1),                                # gap 90 > 32 and 100 > 1.5 * 10
    ([EngineLoad(waiting=25), EngineLoad(running=10)], 1),  # same, through the score (100 vs 10)
    (running(200, 150), 0),                               # gap 50 > 32 but 200 < 1.5 * 150
    (running(30, 10), 0),                                 # 30 > 1.5 * 10 but gap 20 <= 32
])
def test_cache_aware_balance_needs_both_thresholds(loads, expected):
    r = CacheAwareRouter(2)
    assert r.route(REQ_X, running(0, 1)) == 0
    assert r.route(REQ_Y, loads) == expected


def test_cache_aware_balance_ignores_dead_engines():
    r = CacheAwareRouter(3)
    assert r.route(REQ_X, running(0, 1, 1)) == 0
    r.forget(2)
    assert r.route(REQ_Y, running(20, 10, 1000)) == 0  # engine 2's load is not part of the gap


def test_prefix_match_stops_at_first_miss():
    a, b, c = chain_hashes(toks(0, 3))
    r = CacheAwareRouter(2)
    assert r.route([a], running(0, 1)) == 0
    assert r.route([c], running(0, 1)) == 0
    assert r.prefix_match(0, [a, b, c]) == 1
    # 1/3 < cache_threshold: routed by load, although engine 0 holds 2 of the 3 hashes.
    assert r.route([a, b, c], running(5, 0)) == 1


def test_lru_bound_evicts_oldest():
    x, y, z = (chain_hashes(toks(s, 2)) for s in (0, 100, 200))
    r = CacheAwareRouter(1, max_blocks_per_engine=4)
    for req in (x, y, z):
        r.route(req, running(0))
    assert len(r.blocks[0]) == 4
    assert (r.prefix_match(0, x), r.prefix_match(0, y), r.prefix_match(0, z)) == (0, 2, 2)


def test_lru_refreshes_matched_prefix():
    x, y, z = (chain_hashes(toks(s, 2)) for s in (0, 100, 200))
    r = CacheAwareRouter(1, max_blocks_per_engine=4)
    for req in (x, y, x, z):
        r.route(req, running(0))
    assert (r.prefix_match(0, x), r.prefix_match(0, y), r.prefix_match(0, z)) == (2, 0, 2)


def test_lru_evicts_a_prefix_tail_first():
    x, y = chain_hashes(toks(0, 2)), chain_hashes(toks(100, 2))
    r = CacheAwareRouter(1, max_blocks_per_engine=3)
    r.route(x, running(0))
    r.route(y, running(0))
    assert r.prefix_match(0, x) == 1  # x's head survives, so x still partly matches


@pytest.mark.parametrize("policy", ROUTING_POLICIES)
def test_forgotten_engine_never_chosen(policy):
    r = make_router(policy, 3)
    r.route(REQ_X, running(5, 0, 5))  # cache-aware: engine 1 now caches SYSTEM
    r.forget(1)
    rng = random.Random(0)
    for req in (REQ_Y, REQ_Z, OTHER, []) * 5:
        assert r.route(req, running(rng.randint(1, 50), 0, rng.randint(1, 50))) != 1


def test_cache_aware_forget_drops_state():
    r = CacheAwareRouter(2)
    r.route(REQ_X, running(0, 1))
    r.forget(0)
    assert len(r.blocks[0]) == 0 and r.prefix_match(0, REQ_X) == 0


@pytest.mark.parametrize("policy", ROUTING_POLICIES)
def test_all_dead_raises(policy):
    r = make_router(policy, 2)
    r.forget(0)
    r.forget(1)
    with pytest.raises(RuntimeError, match="no engine is alive"):
        r.route(REQ_X, running(0, 0))


def test_make_router():
    assert isinstance(make_router("round_robin", 2), RoundRobinRouter)
    assert isinstance(make_router("least_loaded", 2), LeastLoadedRouter)
    assert isinstance(make_router("cache_aware", 2), CacheAwareRouter)
    with pytest.raises(ValueError) as err:
        make_router("random", 2)
    assert all(name in str(err.value) for name in ROUTING_POLICIES)


def simulate(policy: str, requests: list[tuple[int, list[bytes]]], num_engines: int) -> list[Counter]:
    """Route `requests` with simulated loads: each routed request runs on its engine and
    finishes with probability 0.2 per step. Returns, per tenant, a Counter of engines."""
    router, rng = make_router(policy, num_engines), random.Random(1)
    num_running = [0] * num_engines
    per_tenant = [Counter() for _ in range(max(t for t, _ in requests) + 1)]
    for tenant, hashes in requests:
        engine = router.route(hashes, running(*num_running))
        num_running[engine] += 1
        per_tenant[tenant][engine] += 1
        num_running = [n - sum(rng.random() < 0.2 for _ in range(n)) for n in num_running]
    return per_tenant


def test_multi_tenant_cache_aware_pins_tenants():
    rng = random.Random(0)
    num_tenants, num_engines, k = 8, 4, 4
    prompts = [toks(10_000 * (t + 1), k) for t in range(num_tenants)]
    requests = []
    for i in range(400):
        t = rng.randrange(num_tenants)
        user = [rng.randrange(50_000) for _ in range(BLOCK_SIZE * rng.randint(1, 3))]
        requests.append((t, chain_hashes(prompts[t] + user)))

    def majority_share(c: Counter) -> float:
        return c.most_common(1)[0][1] / sum(c.values())

    cache_aware = simulate("cache_aware", requests, num_engines)
    assert all(majority_share(c) >= 0.9 for c in cache_aware)
    homes = {c.most_common(1)[0][0] for c in cache_aware}
    assert len(homes) >= num_engines - 1  # tenants spread over the engines, not all on one

    round_robin = simulate("round_robin", requests, num_engines)
    assert all(majority_share(c) < 0.5 for c in round_robin)
    assert all(len(c) == num_engines for c in round_robin)


# ---- the coordinator: the loads the router sees --------------------------------------------

def test_coordinator_counts_what_was_routed_since_each_report(monkeypatch):
    from part10_dp import coordinator as coord

    clock = [100.0]
    monkeypatch.setattr(coord.time, "monotonic", lambda: clock[0])
    c = coord.Coordinator(2, silence_limit_s=30)
    clock[0] += 100  # a long start-up: silence counts only from an engine's first word (its ready)
    assert c.silent_engines() == []
    c.report(0, coord.EngineStats(waiting=1, running=2, prefix_queries=100, prefix_hits=25))
    c.report(1, coord.EngineStats(waiting=0, running=5, prefix_queries=100, prefix_hits=75))
    for _ in range(3):
        c.routed(1)
    assert [(l.waiting, l.running) for l in c.loads()] == [(1, 2), (3, 5)]  # unreported ones wait
    assert [l.score for l in c.loads()] == [6, 17]
    c.report(1, coord.EngineStats(waiting=1, running=7))  # the engine's report now includes them
    assert (c.loads()[1].waiting, c.loads()[1].running) == (1, 7)
    assert c.prefix_hit_rate == 25 / 100  # engine 1's new report has no lookups
    clock[0] += 30 + 1
    c.heard(0)
    assert c.silent_engines() == [1]
