"""Part 06: chunked prefill changes how a prompt is computed, never the tokens. Outputs equal HF
(greedy) and the unchunked engine (seeded) at several budgets, including one smaller than a
block and one whose chunks end inside blocks; a prompt many times the budget; prompts that are
an exact multiple of the block size; preemption of a partly prefilled sequence with a step in
flight; running streams get a token every step while a long prompt is admitted; no leaks."""
from __future__ import annotations

import pytest

from conftest import greedy, pool_is_full
from shared.sampling_params import SamplingParams

BUDGETS = [(7, 4), (16, 8), (40, 8)]  # (max_num_batched_tokens, max_num_seqs)


@pytest.fixture(scope="module")
def llm06():
    from conftest import build_llm

    # 16 MiB: 22 blocks of 16 tokens, so 8 prompts of up to ~80 tokens must take turns.
    return build_llm("part06_chunked_prefill", kv_cache_memory_mb=16)


@pytest.fixture(scope="module")
def prompts(prompt_token_ids):
    long = [t for p in prompt_token_ids for t in p][:150]  # many times every budget
    exact = (prompt_token_ids[4] * 3)[:32]  # two whole blocks
    return [long, exact, *prompt_token_ids[:3]]


def configure(llm, budget: int, seats: int, chunked: bool = True):
    cfg = llm.engine.scheduler.config
    cfg.max_num_batched_tokens, cfg.max_num_seqs, cfg.enable_chunked_prefill = budget, seats, chunked


@pytest.mark.parametrize("budget,seats", BUDGETS)
def test_greedy_equals_hf_at_every_budget(llm06, prompts, hf_greedy, budget, seats):
    configure(llm06, budget, seats)
    outs = llm06.generate(prompts, greedy(16))
    for o, p in zip(outs, prompts):
        assert o.outputs[0].token_ids == hf_greedy(p, 16)
    assert pool_is_full(llm06)


def test_seeded_sampling_is_the_same_with_and_without_chunks(llm06, prompts):
    params = [SamplingParams(temperature=1.0, top_p=0.95, seed=100 + i, max_tokens=12, n=1 + i % 2)
              for i in range(len(prompts))]
    configure(llm06, 2048, 8, chunked=False)
    whole = llm06.generate(prompts, params)
    for budget, seats in BUDGETS:
        configure(llm06, budget, seats)
        chunked = llm06.generate(prompts, params)
        for a, b in zip(whole, chunked):
            assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs], budget
    assert pool_is_full(llm06)


def test_preemption_of_a_partly_prefilled_sequence(llm06, prompt_token_ids, prompts, hf_greedy):
    configure(llm06, 16, 8)
    preempted_mid_prompt = []
    sched = llm06.engine.scheduler
    preempt = sched._preempt

    def recording(seq):
        preempted_mid_prompt.append(0 < seq.num_computed_tokens < len(seq.request.prompt_token_ids))
        preempt(seq)

    sched._preempt = recording
    try:
        batch = [prompts[0], *prompt_token_ids]
        outs = llm06.generate(batch, greedy(24))
    finally:
        del sched._preempt
    assert any(preempted_mid_prompt)  # the pool ran dry while a prompt was half computed
    for o, p in zip(outs, batch):
        assert o.outputs[0].token_ids == hf_greedy(p, 24)
    assert pool_is_full(llm06)


def test_running_streams_decode_every_step_while_a_long_prompt_arrives(llm06, prompts, prompt_token_ids):
    configure(llm06, 16, 8)
    engine = llm06.engine
    short = [engine.make_request(p, greedy(30)) for p in prompt_token_ids[4:7]]
    for r in short:
        engine.add_request(r)
    for _ in range(3):  # the short ones are decoding
        engine.step()
    long = engine.make_request(prompts[0], greedy(4))
    engine.add_request(long)
    decoders = {r.sequences[0].seq_id for r in short}
    steps = []
    schedule = engine.scheduler.schedule

    def recording():
        out = schedule()
        steps.append(out)
        return out

    engine.scheduler.schedule = recording
    try:
        while long.sequences[0].num_computed_tokens < len(prompts[0]):
            engine.step()
    finally:
        del engine.scheduler.schedule
    assert len(steps) >= len(prompts[0]) // 16  # the prompt really was split
    for out in steps:
        assert out.num_batched_tokens <= 16
        running_decoders = {s.seq_id for s in engine.scheduler.running} | {
            s.seq_id for s, _ in out.scheduled}
        live = {d for d in decoders if d in running_decoders}
        assert live <= {s.seq_id for s, _ in out.scheduled}  # every live stream got its token
    while engine.has_unfinished_requests():
        engine.step()
    assert pool_is_full(llm06)
