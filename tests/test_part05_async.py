"""Part 05: async scheduling changes when the host learns each token, never which token. Its
outputs equal part 04's for greedy and seeded sampling, n > 1, penalties, logit_bias, min_tokens,
stop strings, EOS and logprobs; no step is scheduled past max_tokens; the step launched after a
sequence finished is thrown away; aborts and preemptions with a step in flight lose nothing; the
model runs on the caller's thread while the engine core steps on its own."""
from __future__ import annotations

import threading

import pytest

from conftest import greedy, pool_is_full
from shared.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def llm05(llm_for):
    return llm_for("part05_async_sched")


def mixed_workload(prompt_token_ids):
    """Every sampling feature, each in its own request, all in one continuous batch."""
    p = prompt_token_ids
    return [
        (p[0], greedy(24)),
        (p[1], SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=20)),
        (p[2], SamplingParams(n=3, temperature=1.0, top_k=40, seed=5, max_tokens=16)),
        (p[3], SamplingParams(temperature=0.7, seed=3, max_tokens=20, presence_penalty=1.5,
                              frequency_penalty=0.5, repetition_penalty=1.3)),
        (p[4], SamplingParams(temperature=0, max_tokens=64)),  # chat prompt: stops at EOS
        (p[5], SamplingParams(temperature=0, max_tokens=40, stop=[" the", "."])),  # a stop string
        (p[6], SamplingParams(temperature=0, max_tokens=12, logprobs=3, ignore_eos=True)),
        (p[7], SamplingParams(temperature=0, max_tokens=20, min_tokens=10, repetition_penalty=1.2)),
        (p[0], SamplingParams(temperature=0, max_tokens=10, logit_bias={11: 5.0, 30: -100.0},
                              ignore_eos=True)),
        (p[1], SamplingParams(n=2, temperature=0.9, seed=8, max_tokens=14, stop=["\n"])),
    ]


def assert_same(a, b):
    assert len(a) == len(b)
    for ra, rb in zip(a, b):
        assert len(ra.outputs) == len(rb.outputs)
        for ca, cb in zip(ra.outputs, rb.outputs):
            assert ca.token_ids == cb.token_ids
            assert ca.text == cb.text
            assert (ca.finish_reason, ca.stop_reason) == (cb.finish_reason, cb.stop_reason)
            if ca.logprobs is not None:
                assert [sorted(d) for d in ca.logprobs] == [sorted(d) for d in cb.logprobs]
                # Batches differ between the two runs, so fp32 sums differ by ~1e-5 per token over
                # up to 14 tokens; a wrong logprob is >1e-2 off.
                assert ca.cumulative_logprob == pytest.approx(cb.cumulative_logprob, abs=1e-3)


def test_same_outputs_as_part04(llm04, llm05, prompt_token_ids):
    work = mixed_workload(prompt_token_ids)
    prompts, params = [w[0] for w in work], [w[1] for w in work]
    ours = llm05.generate(prompts, params)
    ref = llm04.generate(prompts, params)
    assert_same(ours, ref)
    reasons = {c.finish_reason for r in ours for c in r.outputs}
    assert reasons == {"stop", "length"}  # both kinds of ending were exercised
    assert pool_is_full(llm05)


def test_off_switch_gives_the_same_outputs(llm05, prompt_token_ids):
    work = mixed_workload(prompt_token_ids)
    on = llm05.generate([w[0] for w in work], [w[1] for w in work])
    llm05.engine.max_steps_in_flight = 1
    try:
        off = llm05.generate([w[0] for w in work], [w[1] for w in work])
    finally:
        llm05.engine.max_steps_in_flight = 2
    assert_same(on, off)


def count_schedules(engine):
    """Wrap the scheduler: how many steps each sequence was scheduled in, and the largest number
    of steps ever in flight."""
    counts: dict[str, int] = {}
    schedule = engine.scheduler.schedule

    def counting():
        out = schedule()
        for seq, _ in out.scheduled:
            counts[seq.seq_id] = counts.get(seq.seq_id, 0) + 1
        return out

    engine.scheduler.schedule = counting
    return counts


def test_max_tokens_exactly_no_step_beyond(llm05, prompt_token_ids, hf_greedy):
    engine = llm05.engine
    counts = count_schedules(engine)
    try:
        reqs = [engine.make_request(p, greedy(n)) for p, n in zip(prompt_token_ids[:4], (1, 2, 7, 15))]
        for r in reqs:
            engine.add_request(r)
        in_flight = 0
        while engine.has_unfinished_requests():
            engine.step()
            in_flight = max(in_flight, len(engine.batch_queue))
    finally:
        del engine.scheduler.schedule
    assert in_flight == 1  # between steps, one step is always left in flight
    for r, p, n in zip(reqs, prompt_token_ids, (1, 2, 7, 15)):
        assert r.output().outputs[0].token_ids == hf_greedy(p, n)
        assert counts[r.sequences[0].seq_id] == n  # one step per token: none past max_tokens
    assert pool_is_full(llm05)


def test_a_late_finish_costs_one_step_and_its_token_is_discarded(llm05, prompt_token_ids):
    engine = llm05.engine
    counts = count_schedules(engine)
    try:
        eos = engine.make_request(prompt_token_ids[4], SamplingParams(temperature=0, max_tokens=64))
        stop = engine.make_request(prompt_token_ids[0], SamplingParams(temperature=0, max_tokens=64,
                                                                       stop=["Paris"]))
        engine.generate([eos, stop])
    finally:
        del engine.scheduler.schedule
    e, s = eos.output().outputs[0], stop.output().outputs[0]
    assert e.finish_reason == "stop" and e.stop_reason is None and len(e.token_ids) < 64
    assert e.token_ids[-1] in engine.eos_token_ids  # nothing after EOS was emitted
    assert counts[eos.sequences[0].seq_id] == len(e.token_ids) + 1  # the one wasted step
    assert s.finish_reason == "stop" and s.stop_reason == "Paris" and "Paris" not in s.text
    # The stop string ended the sequence in the engine too: at most one more step ran.
    assert counts[stop.sequences[0].seq_id] <= len(s.token_ids) + 1
    assert pool_is_full(llm05)


def test_abort_with_a_step_in_flight(llm05, prompt_token_ids, hf_greedy):
    engine = llm05.engine
    reqs = [engine.make_request(p, greedy(20)) for p in prompt_token_ids[:4]]
    for r in reqs:
        engine.add_request(r)
    for _ in range(4):
        engine.step()
    assert engine.batch_queue  # a step is in flight right now
    engine.abort_request(reqs[1])
    engine.abort_request(reqs[2])
    while engine.has_unfinished_requests():
        engine.step()
    assert reqs[1].output().outputs[0].finish_reason == "abort"
    for i in (0, 3):
        assert reqs[i].output().outputs[0].token_ids == hf_greedy(prompt_token_ids[i], 20)
    assert pool_is_full(llm05)


def test_preemption_with_a_step_in_flight(prompt_token_ids, hf_greedy):
    from conftest import build_llm

    small = build_llm("part05_async_sched", kv_cache_memory_mb=8)  # 11 blocks for 8 requests
    outs = small.generate(prompt_token_ids, greedy(32))
    assert small.engine.scheduler.num_preemptions > 0
    for o, ids in zip(outs, prompt_token_ids):
        assert o.outputs[0].token_ids == hf_greedy(ids)
    assert pool_is_full(small)


def test_the_model_keeps_the_callers_thread(llm05, prompt_token_ids):
    runner = llm05.engine.runner
    threads: set[str] = set()
    execute = runner.execute_model

    def recording(inp):
        threads.add(threading.current_thread().name)
        return execute(inp)

    runner.execute_model = recording
    core_threads: set[str] = set()
    update = llm05.engine._update_from_output

    def recording_update(*a):
        core_threads.add(threading.current_thread().name)
        return update(*a)

    llm05.engine._update_from_output = recording_update
    try:
        llm05.generate(prompt_token_ids[:2], greedy(4))
    finally:
        del runner.execute_model, llm05.engine._update_from_output
    assert threads == {threading.current_thread().name}
    assert core_threads == {"engine-core"}
