"""Part 07: prefix caching changes what is computed, never the tokens. Outputs equal HF (greedy)
and the engine with the cache off (seeded, n > 1) with chunked prefill and async scheduling on;
a second identical request computes only its last block (a whole one when the prompt is an exact
multiple of the block size); a preempted sequence re-hits its own blocks, counted apart;
`cache_salt` isolates tenants, offline and over HTTP; nothing leaks and every refcount is zero at
rest."""
from __future__ import annotations

import httpx
import pytest

from conftest import greedy, pool_is_full, running_server
from shared.errors import InvalidRequestError
from shared.sampling_params import SamplingParams

PART = "part07_prefix_cache"


@pytest.fixture(scope="module")
def llm07():
    from conftest import build_llm

    # 16 MiB: 22 blocks of 16 tokens, small enough to force preemptions below.
    return build_llm(PART, kv_cache_memory_mb=16)


@pytest.fixture(scope="module")
def shared_prefix(prompt_token_ids):
    return [t for p in prompt_token_ids[4:6] for t in p][:40]  # 2.5 blocks of a "system prompt"


def configure(llm, budget=1024, seats=8, caching=True):
    cfg = llm.engine.scheduler.config
    cfg.max_num_batched_tokens, cfg.max_num_seqs = budget, seats
    llm.engine.kv_cache_manager.enable_caching = caching
    assert llm.reset_prefix_cache()


def at_rest(llm) -> bool:
    return pool_is_full(llm) and all(b.ref_cnt == 0 for b in llm.engine.kv_cache_manager.block_pool.blocks)


def computed_tokens(llm, prompts, params):
    """Generate, and count the tokens each prompt's steps computed before its first sample."""
    engine, counts = llm.engine, {}
    schedule = engine.scheduler.schedule

    def recording():
        out = schedule()
        for s, n in out.scheduled:
            # The prompt's steps: nothing generated yet, at most the first token in flight.
            if not s.state.token_ids and s.num_output_placeholders <= 1:
                counts[s.request.request_id] = counts.get(s.request.request_id, 0) + n
        return out

    engine.scheduler.schedule = recording
    try:
        outs = llm.generate(prompts, params)
    finally:
        del engine.scheduler.schedule
    return outs, [counts[o.request_id] for o in outs]


def test_greedy_equals_hf_cold_and_warm_with_chunks(llm07, prompt_token_ids, shared_prefix, hf_greedy):
    configure(llm07, budget=16)
    prompts = [shared_prefix + p for p in prompt_token_ids[:4]]
    stats = llm07.engine.prefix_cache_stats
    hits0 = stats.hits
    for run in ("cold", "warm"):
        outs = llm07.generate(prompts, greedy(16))
        for o, p in zip(outs, prompts):
            assert o.outputs[0].token_ids == hf_greedy(p, 16), run
    assert stats.hits - hits0 >= 3 * 32 + 4 * 32  # cold: 3 share the prefix; warm: all of it
    assert at_rest(llm07)


def test_seeded_sampling_is_the_same_with_the_cache_on_and_off(llm07, prompt_token_ids, shared_prefix):
    prompts = [shared_prefix + p for p in prompt_token_ids[2:6]]
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=7 + i, max_tokens=10, n=1 + i % 2,
                             presence_penalty=0.5 * (i % 2)) for i in range(len(prompts))]
    configure(llm07, budget=24, caching=False)
    off = llm07.generate(prompts, params)
    configure(llm07, budget=24)
    for _ in range(2):  # cold, then warm (hits the prompts themselves)
        on = llm07.generate(prompts, params)
        for a, b in zip(off, on):
            assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert llm07.engine.prefix_cache_stats.hits > 0 and at_rest(llm07)


@pytest.mark.parametrize("length,expected", [(45, 45 - 32), (48, 16)])
def test_second_identical_request_computes_only_its_last_block(llm07, prompt_token_ids, length, expected):
    configure(llm07)
    prompt = [t for p in prompt_token_ids for t in p][:length]
    _, [first] = computed_tokens(llm07, [prompt], greedy(2))
    _, [second] = computed_tokens(llm07, [prompt], greedy(2))
    assert (first, second) == (length, expected)  # 48 = 3 whole blocks: the last one is recomputed
    assert at_rest(llm07)


def test_preempted_sequences_re_hit_their_blocks_uncounted(llm07, prompt_token_ids, hf_greedy):
    configure(llm07, budget=64)
    stats = llm07.engine.prefix_cache_stats
    before = (stats.requests, stats.preempted_hits)
    outs = llm07.generate(prompt_token_ids, greedy(32))
    for o, p in zip(outs, prompt_token_ids):
        assert o.outputs[0].token_ids == hf_greedy(p, 32)
    assert llm07.engine.scheduler.num_preemptions > 0
    assert stats.preempted_hits > before[1]  # resumes found their own blocks still cached
    assert stats.requests - before[0] == len(prompt_token_ids)  # each sequence counted once
    assert at_rest(llm07)


def test_cache_salt_isolates_requests(llm07, prompt_token_ids):
    configure(llm07)
    engine, stats = llm07.engine, llm07.engine.prefix_cache_stats
    prompt = [t for p in prompt_token_ids for t in p][:50]

    def hits(salt):
        before = stats.hits
        llm07.generate([{"prompt_token_ids": prompt, "cache_salt": salt}], greedy(1))
        return stats.hits - before

    assert hits("tenant-a") == 0
    assert hits("tenant-b") == 0 and hits(None) == 0
    assert hits("tenant-a") == 48 and hits(None) == 48
    with pytest.raises(InvalidRequestError):
        engine.make_request(prompt, greedy(1), cache_salt="")
    assert at_rest(llm07)


def test_cache_salt_over_http(llm07, prompt_token_ids):
    from part07_prefix_cache.server import build_app

    configure(llm07)
    stats = llm07.engine.prefix_cache_stats
    prompt = [t for p in prompt_token_ids for t in p][:40]
    with running_server(build_app(llm07, "m")) as url:
        def post(salt):
            before = stats.hits
            body = {"prompt": prompt, "max_tokens": 1, **({"cache_salt": salt} if salt is not None else {})}
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            return r, stats.hits - before

        assert post("a")[1] == 0 and post("b")[1] == 0 and post("a")[1] == 32
        r, _ = post("")
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
        assert post(None)[0].status_code == 200
    assert at_rest(llm07)
