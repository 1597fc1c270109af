"""Part 04: continuous batching keeps every request's greedy output equal to HF's while many run
at once, requests join and leave mid-flight, sequences are preempted and recomputed, and no
block leaks."""
from __future__ import annotations

from conftest import build_llm, greedy, pool_is_full
from shared.sampling_params import SamplingParams


def workload(prompt_token_ids):
    """16 requests of different prompt and output lengths."""
    prompts = prompt_token_ids + [ids[: max(3, len(ids) // 2)] for ids in prompt_token_ids]
    lengths = [8 + (5 * i) % 25 for i in range(len(prompts))]
    return prompts, lengths


def test_sixteen_concurrent_requests_match_hf(llm04, prompt_token_ids, hf_greedy):
    engine = llm04.engine
    prompts, lengths = workload(prompt_token_ids)
    requests = [engine.make_request(p, greedy(n)) for p, n in zip(prompts, lengths)]
    for r in requests:
        engine.add_request(r)
    most_running = 0
    while engine.has_unfinished_requests():
        engine.step()
        most_running = max(most_running, len(engine.scheduler.running))
    assert most_running == len(requests)  # they really ran together
    for r, p, n in zip(requests, prompts, lengths):
        assert r.output().outputs[0].token_ids == hf_greedy(p, n)
    assert pool_is_full(llm04)


def test_requests_join_and_leave_mid_flight(llm04, prompt_token_ids, hf_greedy):
    engine = llm04.engine
    first = [engine.make_request(p, greedy(n)) for p, n in zip(prompt_token_ids[:4], [6, 20, 12, 30])]
    for r in first:
        engine.add_request(r)
    for _ in range(7):
        engine.step()
    assert first[0].finished and not first[1].finished  # one left already, others still run
    late = [engine.make_request(p, greedy(16)) for p in prompt_token_ids[4:]]
    for r in late:
        engine.add_request(r)
    while engine.has_unfinished_requests():
        engine.step()
    for r, p, n in zip(first, prompt_token_ids[:4], [6, 20, 12, 30]):
        assert r.output().outputs[0].token_ids == hf_greedy(p, n)
    for r, p in zip(late, prompt_token_ids[4:]):
        assert r.output().outputs[0].token_ids == hf_greedy(p, 16)
    assert pool_is_full(llm04)


def test_preempted_requests_finish_with_identical_output(prompt_token_ids, hf_greedy):
    # 11 blocks of 16 tokens for 8 requests of up to 72 tokens
    small = build_llm("part04_continuous_batching", kv_cache_memory_mb=8)
    outs = small.generate(prompt_token_ids, greedy(32))
    assert small.engine.scheduler.num_preemptions > 0
    for o, ids in zip(outs, prompt_token_ids):
        assert o.outputs[0].token_ids == hf_greedy(ids)
    assert pool_is_full(small)


def test_static_mode_gives_the_same_tokens(llm04, prompt_token_ids, hf_greedy):
    sched = llm04.engine.scheduler
    sched.config.continuous_batching = False
    try:
        outs = llm04.generate(prompt_token_ids[:4], [greedy(n) for n in (5, 10, 15, 20)])
    finally:
        sched.config.continuous_batching = True
    for o, ids, n in zip(outs, prompt_token_ids, (5, 10, 15, 20)):
        assert o.outputs[0].token_ids == hf_greedy(ids, n)


def test_aborts_free_their_blocks(llm04, prompt_token_ids, hf_greedy):
    engine = llm04.engine
    requests = [engine.make_request(p, greedy(24)) for p in prompt_token_ids[:6]]
    for r in requests:
        engine.add_request(r)
    for _ in range(3):
        engine.step()
    engine.abort_request(requests[1])
    engine.abort_request(requests[4])
    while engine.has_unfinished_requests():
        engine.step()
    assert requests[1].output().outputs[0].finish_reason == "abort"
    for i in (0, 2, 3, 5):
        assert requests[i].output().outputs[0].token_ids == hf_greedy(prompt_token_ids[i], 24)
    assert pool_is_full(llm04)


def test_seeded_sampling_does_not_depend_on_the_batch(llm04, prompt_token_ids):
    params = SamplingParams(n=2, temperature=1.0, top_p=0.9, seed=1234, max_tokens=12)
    alone = llm04.generate([prompt_token_ids[2]], params)[0]
    crowd = llm04.generate(prompt_token_ids[:5], [greedy(12), greedy(8), params, greedy(12), greedy(3)])[2]
    assert [c.token_ids for c in alone.outputs] == [c.token_ids for c in crowd.outputs]
    assert pool_is_full(llm04)
