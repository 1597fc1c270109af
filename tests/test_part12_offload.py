"""Part 12: a host KV tier (swap on preemption, offloaded prefix blocks) on real engines.

- Greedy output equals HF's with a device pool so small that requests are preempted, by swap and by
  recompute; seeded sampling (n=2) equals part 11's with a host tier too small for every swap (the
  fallback recomputes) and with prefix hits served from the host tier.
- A swapped request's KV comes back bit-equal; aborts while a swap or a load is in flight lose
  nothing; after every run no block is left held in either tier.
- cache_salt isolation holds in the host tier; with no host tier the engine is part 11's (same
  outputs, same steps, same preemptions); at TP 2 each rank copies its shard and the output equals TP 1.
Part 13 moves the host tier behind its KV-connector interface (the OffloadingConnector) without
changing what it does: every test here runs on both parts, and on the latest. The manager and its eviction policies are
tested model-free in test_offload_manager.py and test_cache_policy.py."""
from __future__ import annotations

import random

import pytest
import torch

from conftest import NEW_TOKENS, PARTS, build_llm, greedy, part_number, save_tiny
from shared.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("release_memory_after_each_test")

# Part 12 (the host tier), part 13 (the same tier behind the KV-connector interface) and the latest
# part (everything on top). Part 14 changes only the model's linear layers over part 13's engine.
HOST_TIER_PARTS = sorted({p for p in PARTS if part_number(p) in (12, 13)} | {PARTS[-1]})


@pytest.fixture(scope="module", params=HOST_TIER_PARTS)
def part(request):
    return request.param


def host_tier(engine):
    """The host tier's scheduler half: part 12's `offload`, part 13's OffloadingConnector."""
    return engine.offload if hasattr(engine, "offload") else engine.connector


def pending(tier) -> bool:
    return tier.busy if hasattr(tier, "busy") else tier.has_pending_work()


def loading(scheduler) -> list:
    q = scheduler.loading
    return [s for s, _ in q.values()] if isinstance(q, dict) else list(q)
# head_dim 64, so a KV block is 64 KiB and a 1 MiB pool holds 16 blocks (256 tokens): small enough to preempt.
TINY = dict(vocab_size=128, hidden_size=256, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=1,
            eos_token_id=127, tie_word_embeddings=False)
BLOCK_BYTES_TINY = 2 * 4 * 16 * 2 * 64 * 4  # K and V x layers x block size x KV heads x head dim x fp32


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import LlamaConfig

    return save_tiny(tmp_path_factory.mktemp("offload") / "tiny", LlamaConfig(**TINY), seed=0, scale=0.3)


def tiny_llm(path, part, **kw):
    import importlib

    return importlib.import_module(part).LLM(model=str(path), device="cpu", dtype="float32", **kw)


def host_gib(blocks: int) -> float:
    return blocks * BLOCK_BYTES_TINY / 2**30


def prompts(n: int, seed: int = 0, lo: int = 20, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(2, 127) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def both_tiers_empty(llm) -> bool:
    """Every device block back in the pool, no request holding any, every host block free or cached
    (none reserved for a swapped request, none pinned or being written), no copy pending."""
    engine = llm.engine
    kv, offload = engine.kv_cache_manager, host_tier(engine)
    device_ok = kv.num_free_blocks == engine.executor.num_blocks - 1 and not kv.req_to_blocks
    if offload is None:
        return device_ok
    m = offload.manager
    host_ok = not m.reserved and all(b.ref_cnt == 0 for _, b in m.policy.items())
    host_ok &= m.num_free_blocks + len(list(m.policy.items())) == m.num_blocks
    return device_ok and host_ok and not pending(offload) and not engine.scheduler.has_unfinished()


def tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_greedy_equals_hf_when_a_tiny_pool_preempts(part, mode, prompt_token_ids, hf_greedy):
    # 12 MiB: 16 blocks of 16 tokens for 8 sequences that grow to ~40-70 tokens each.
    llm = build_llm(part, kv_cache_memory_mb=12, kv_offloading_size=0.05, preemption_mode=mode)
    try:
        outs = llm.generate([list(p) for p in prompt_token_ids], greedy(NEW_TOKENS))
        for ids, out in zip(prompt_token_ids, outs):
            assert out.outputs[0].token_ids == hf_greedy(ids, NEW_TOKENS)
        stats = host_tier(llm.engine).stats
        assert llm.engine.scheduler.num_preemptions > 0
        if mode == "swap":
            assert stats.swaps_out > 0 and stats.swaps_in == stats.swaps_out and stats.swap_fallbacks == 0
            assert stats.bytes_swapped_out > 0 and stats.bytes_loaded >= stats.bytes_swapped_out
        else:
            assert stats.swaps_out == 0
        assert both_tiers_empty(llm)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("host_blocks", [6, 64])
def test_seeded_sampling_is_unchanged_by_swaps_fallbacks_and_prefix_hits(part, tiny, host_blocks):
    """Swap with a 6-block host tier: some victims find no room and are recomputed. With 64 blocks,
    a second pass, after emptying the device cache, finds the prompts' prefixes in the host tier.
    Each sample must be what the same part draws with a pool that never swaps."""
    ps = prompts(10)
    # top_k=2: each draw picks between two tokens of comparable weight, so a request's generator
    # drawing out of step (or wrong K/V) changes many tokens. The reference is the same part, not
    # part 11: on this tiny random model part 15's C kernels and part 11's torch layers give logprobs
    # up to 6e-4 apart (float rounding, amplified through the layers), and a draw that lands within
    # that of a boundary flips, which failed a run now and then. Part 15's results do not depend on
    # which requests share its steps (its logprobs with and without swaps: equal to the bit), so
    # against itself nothing but the swaps can move a token. Parts 12-14's torch attention pads a
    # step's decode rows to the longest, so their last bits move with the grouping, as part 11's do.
    params = SamplingParams(temperature=0.9, top_k=2, seed=7, n=2, max_tokens=24, logprobs=1)
    reference = tiny_llm(tiny, part, kv_cache_memory_mb=64)
    try:
        want = reference.generate(ps, params)
    finally:
        reference.shutdown()
    llm = tiny_llm(tiny, part, kv_cache_memory_mb=1, kv_offloading_size=host_gib(host_blocks), preemption_mode="swap",
                   max_num_batched_tokens=128)
    try:
        assert host_tier(llm.engine).manager.num_blocks == host_blocks
        assert tokens(llm.generate(ps, params)) == tokens(want)
        stats = host_tier(llm.engine).stats
        assert stats.swaps_out > 0 and both_tiers_empty(llm)
        if host_blocks == 6:
            assert stats.swap_fallbacks > 0  # the host tier filled up: those were recomputed
            return
        llm.engine.kv_cache_manager.reset_prefix_cache()  # the device forgets; the host tier keeps
        assert tokens(llm.generate(ps, params)) == tokens(want)
        assert stats.host_hits > 0 and stats.bytes_loaded > 0
        assert both_tiers_empty(llm)
    finally:
        llm.shutdown()


def test_prefix_hits_from_the_host_tier_skip_their_compute(part, tiny):
    """Tenants sharing 64-token system prompts, more than the device pool holds: with the host tier
    their prefixes come back by copy, and the engine computes fewer prompt tokens."""
    rng = random.Random(1)
    systems = [[1] + [rng.randrange(2, 127) for _ in range(63)] for _ in range(6)]
    ps = [s + [rng.randrange(2, 127) for _ in range(5)] for _ in range(2) for s in systems]
    want = tiny_llm(tiny, "part11_ep", kv_cache_memory_mb=64).generate(ps, greedy(4))
    computed, hits = {}, 0
    for size in (None, host_gib(64)):
        llm = tiny_llm(tiny, part, kv_cache_memory_mb=1, kv_offloading_size=size, max_num_seqs=2)
        try:
            steps = []
            schedule = llm.engine.scheduler.schedule
            llm.engine.scheduler.schedule = lambda: (out := schedule(), steps.append(out.num_batched_tokens))[0]
            outs = [llm.generate(p, greedy(4))[0] for p in ps]  # one at a time: each finds the earlier
            assert [o.outputs[0].token_ids for o in outs] == [w.outputs[0].token_ids for w in want]
            computed[size] = sum(steps)
            if size is not None:
                hits = host_tier(llm.engine).stats.host_hits
                assert both_tiers_empty(llm)
        finally:
            llm.shutdown()
    assert hits >= 3 * 64  # most second visits find their tenant's 4 full blocks in host memory
    assert computed[host_gib(64)] < computed[None]


def test_cache_salt_isolation_holds_in_the_host_tier(part, tiny):
    rng = random.Random(2)
    prompt = [1] + [rng.randrange(2, 127) for _ in range(80)]
    llm = tiny_llm(tiny, part, kv_cache_memory_mb=1, kv_offloading_size=host_gib(32))
    try:
        llm.generate({"prompt_token_ids": prompt, "cache_salt": "alice"}, greedy(2))
        kv, stats = llm.engine.kv_cache_manager, host_tier(llm.engine).stats
        kv.reset_prefix_cache()
        llm.generate({"prompt_token_ids": prompt, "cache_salt": "bob"}, greedy(2))
        assert stats.host_hits == 0  # bob's blocks hash differently from the first block on
        kv.reset_prefix_cache()
        llm.generate({"prompt_token_ids": prompt, "cache_salt": "alice"}, greedy(2))
        assert stats.host_hits == 80 // 16 * 16
        assert both_tiers_empty(llm)
    finally:
        llm.shutdown()


def test_a_swapped_requests_kv_comes_back_bit_equal(part, tiny):
    """The device KV of a victim at its swap-out, against its new device blocks once the swap-in is
    done, over every slot it had computed."""
    llm = tiny_llm(tiny, part, kv_cache_memory_mb=1, kv_offloading_size=host_gib(64), preemption_mode="swap",
                   async_scheduling=False, max_num_batched_tokens=128)
    engine = llm.engine
    k_cache, v_cache = engine.executor.runner.attn.k_cache, engine.executor.runner.attn.v_cache
    offload, snapshots, checked = host_tier(engine), {}, []
    update_name = "update_from_offload" if hasattr(engine.scheduler, "update_from_offload") else "update_from_kv_connector"
    swap_out, update = offload.swap_out, getattr(engine.scheduler, update_name)

    def slots(block_ids, n):
        ids = torch.tensor(block_ids)
        return [c[:, ids].flatten(1, 2)[:, :n].clone() for c in (k_cache, v_cache)]

    def recording_swap_out(seq):
        snapshots[seq.seq_id] = (slots(engine.kv_cache_manager.get_block_ids(seq.seq_id), seq.num_computed_tokens),
                                 seq.num_computed_tokens)
        return swap_out(seq)

    def checking_update(output):
        before = loading(engine.scheduler)
        result = update(output)
        for seq in before:
            if seq not in loading(engine.scheduler) and seq.seq_id in snapshots:
                want, n = snapshots.pop(seq.seq_id)
                got = slots(engine.kv_cache_manager.get_block_ids(seq.seq_id), n)
                checked.append(all(torch.equal(a, b) for a, b in zip(got, want)))
        return result

    offload.swap_out = recording_swap_out
    setattr(engine.scheduler, update_name, checking_update)
    try:
        llm.generate(prompts(8, seed=3), greedy(30))
        assert checked and all(checked)
        assert both_tiers_empty(llm)
    finally:
        llm.shutdown()


def test_aborts_while_a_swap_or_a_load_is_in_flight_lose_nothing(part, tiny):
    llm = tiny_llm(tiny, part, kv_cache_memory_mb=1, kv_offloading_size=host_gib(64), preemption_mode="swap",
                   max_num_batched_tokens=128)
    engine, sched = llm.engine, llm.engine.scheduler
    ps = prompts(8, seed=4)
    want = tiny_llm(tiny, "part11_ep", kv_cache_memory_mb=64).generate(ps, greedy(30))
    try:
        reqs = [engine.add_request(engine.processor.process_inputs(p, greedy(30))) for p in ps]
        aborted = set()
        for _ in range(2000):
            if not engine.has_unfinished_requests():
                break
            engine.step()
            for queue in (sched.swapped, loading(sched)):  # abort one request caught in each state
                victim = next((s.request for s in queue if s.request.request_id not in aborted), None)
                if victim is not None and len(aborted) < 3:
                    engine.abort_request(victim.request_id)
                    aborted.add(victim.request_id)
        assert len(aborted) >= 2 and not engine.has_unfinished_requests()
        for r, w in zip(reqs, want):
            if r.request_id not in aborted:
                assert r.output().outputs[0].token_ids == w.outputs[0].token_ids
            else:
                assert r.output().outputs[0].finish_reason == "abort"
        assert both_tiers_empty(llm)
    finally:
        llm.shutdown()


def test_without_a_host_tier_the_engine_is_part11(part, tiny):
    """Same outputs, same steps, same preemptions as part 11 on a pool that preempts."""
    ps = prompts(8, seed=5)
    runs = {}
    for p in ("part11_ep", part):
        llm = tiny_llm(tiny, p, kv_cache_memory_mb=1, max_num_batched_tokens=128)
        counts = []
        step = llm.engine.step
        llm.engine.step = lambda: (counts.append(1), step())[1]
        outs = llm.generate(ps, greedy(30))
        runs[p] = (tokens(outs), len(counts), llm.engine.scheduler.num_preemptions)
        assert runs[p][2] > 0
    assert runs[part] == runs["part11_ep"]


def test_swap_at_tp2_equals_tp1(part, tiny):
    """Each rank swaps its own heads; a job is done when both are. At TP 2 a rank's blocks are half
    the bytes, so the same 1 MiB holds 32: the load is larger to make it preempt."""
    ps = prompts(8, seed=6, lo=40, hi=80)
    want = tiny_llm(tiny, "part11_ep", kv_cache_memory_mb=64).generate(ps, greedy(32))
    llm = tiny_llm(tiny, part, tensor_parallel_size=2, kv_cache_memory_mb=1, kv_offloading_size=host_gib(32),
                   preemption_mode="swap", max_num_batched_tokens=128)
    procs = list(llm.engine.executor.procs.values())
    try:
        assert tokens(llm.generate(ps, greedy(32))) == tokens(want)
        assert host_tier(llm.engine).stats.swaps_out > 0
        assert both_tiers_empty(llm)
    finally:
        llm.shutdown()
    assert not any(p.is_alive() for p in procs)


def test_bad_offload_settings_are_refused(part, tiny):
    with pytest.raises(ValueError, match="kv-offloading-size"):
        tiny_llm(tiny, part, preemption_mode="swap")
    with pytest.raises(ValueError, match="recompute(,| or) swap"):  # part 15 lists every problem (validate)
        tiny_llm(tiny, part, preemption_mode="evict")
    with pytest.raises(ValueError, match="fifo"):
        tiny_llm(tiny, part, kv_offloading_size=0.01, kv_offloading_eviction_policy="fifo")
