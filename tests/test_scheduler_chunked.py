"""The part 06 scheduler, without a model: a per-step token budget that is never exceeded,
decode-first ordering, prompts split into chunks (boundaries inside a block and on one, a budget
smaller than a block, a prompt many times the budget), only a prompt's last chunk samples (and
gets a placeholder), long_prefill_token_threshold, preemption of a partly prefilled sequence,
and the off-switch."""
from __future__ import annotations

import pytest

from part06_chunked_prefill.kv_cache_manager import KVCacheManager
from part06_chunked_prefill.request import Sequence
from part06_chunked_prefill.scheduler import Scheduler, SchedulerConfig
from sched_fakes import arrive, make_seq, names

BS = 4


def make(budget=8, num_blocks=64, max_num_seqs=8, chunked=True, threshold=0):
    kv = KVCacheManager(num_blocks, BS)
    return Scheduler(SchedulerConfig(max_num_seqs, budget, True, None, chunked, threshold), kv), kv


def seq(name: str, prompt_len: int, max_tokens: int | None = 100) -> Sequence:
    return make_seq(Sequence, name, prompt_len, max_tokens)


def step(sched: Scheduler):
    """Schedule one step and let its sampled tokens arrive (async off)."""
    out = sched.schedule()
    assert out.num_batched_tokens <= sched.config.max_num_batched_tokens
    for (s, _), samples in zip(out.scheduled, out.samples):
        if samples:
            arrive(s)
    return out


def test_a_long_prompt_is_split_and_only_its_last_chunk_samples():
    sched, kv = make(budget=8)
    a = seq("a", 21)  # 8 + 8 + 5
    sched.add(a)
    chunks = []
    for _ in range(3):
        out = step(sched)
        chunks.append((names(out), out.samples))
    assert chunks == [([("a", 8)], [False]), ([("a", 8)], [False]), ([("a", 5)], [True])]
    assert a.num_computed_tokens == 21 and a.num_tokens == 22  # the first token arrived
    assert len(kv.get_block_ids("a")) == 6  # 21 tokens -> 6 blocks of 4 (block 6 is partial)


@pytest.mark.parametrize("budget,prompt", [(6, 13), (4, 12), (3, 10), (8, 16)])
def test_chunk_boundaries_inside_and_on_blocks(budget, prompt):
    """Budget 6 and 3 cut inside blocks of 4; 4 and 8 cut exactly on them; 12 and 16 are exact
    multiples of the block size. Whatever the cut, the blocks cover exactly what was computed."""
    sched, kv = make(budget=budget)
    a = seq("a", prompt)
    sched.add(a)
    computed = []
    while a.num_tokens == prompt:
        step(sched)
        computed.append(a.num_computed_tokens)
        assert len(kv.get_block_ids("a")) == -(-a.num_computed_tokens // BS)
    assert computed == [min(prompt, budget * (i + 1)) for i in range(len(computed))]


def test_decode_first_then_partial_prefills_then_waiting():
    sched, _ = make(budget=10, max_num_seqs=4)
    d1, d2 = seq("d1", 3), seq("d2", 3)
    sched.add(d1)
    sched.add(d2)
    step(sched)  # both prefilled at once (6 tokens), each has its first token
    long = seq("long", 30)
    sched.add(long)
    assert names(step(sched)) == [("d1", 1), ("d2", 1), ("long", 8)]
    late = seq("late", 5)
    sched.add(late)
    # Decodes first, then the partly prefilled prompt; nothing left for the newcomer.
    assert names(step(sched)) == [("d1", 1), ("d2", 1), ("long", 8)]
    assert list(sched.waiting) == [late]


def test_a_newer_decode_goes_before_an_older_prefill():
    sched, _ = make(budget=8, threshold=4)
    p, d = seq("p", 20), seq("d", 2)
    sched.add(p)
    sched.add(d)
    assert names(step(sched)) == [("p", 4), ("d", 2)]
    assert names(step(sched)) == [("d", 1), ("p", 4)]  # p is older, d decodes: d first


def test_a_budget_smaller_than_a_block():
    sched, kv = make(budget=3, max_num_seqs=2)
    a = seq("a", 10)
    sched.add(a)
    outs = [names(step(sched)) for _ in range(4)]
    assert outs == [[("a", 3)], [("a", 3)], [("a", 3)], [("a", 1)]]
    assert a.num_tokens == 11  # sampled once, at the end of its prompt


def test_long_prefill_token_threshold_lets_others_in():
    sched, _ = make(budget=12, threshold=5)
    a, b = seq("a", 20), seq("b", 20)
    sched.add(a)
    sched.add(b)
    assert names(step(sched)) == [("a", 5), ("b", 5)]


def test_placeholders_only_for_sequences_that_sample():
    sched, _ = make(budget=8)
    a, b = seq("a", 2), seq("b", 20)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()  # async: nothing arrives before the next schedule
    assert names(out) == [("a", 2), ("b", 6)] and out.samples == [True, False]
    assert a.num_output_placeholders == 1 and b.num_output_placeholders == 0
    out = sched.schedule()  # a decodes on its placeholder; b's next chunk is all known tokens
    assert names(out) == [("a", 1), ("b", 7)] and out.samples == [True, False]
    assert a.num_output_placeholders == 2 and b.num_output_placeholders == 0


def test_preempting_a_partly_prefilled_sequence():
    sched, kv = make(budget=8, num_blocks=6)  # 5 usable blocks of 4
    a, b = seq("a", 7), seq("b", 20)
    sched.add(a)
    sched.add(b)
    step(sched)  # a: 7 (2 blocks), b: 1 (1 block)
    step(sched)  # a decodes (8 tokens, 2 blocks); b: 7 more -> 8 tokens (2 blocks): pool full
    assert kv.num_free_blocks == 1 and b.num_computed_tokens == 8
    out = step(sched)  # a needs a 3rd block: b (newest, partly prefilled) is preempted
    assert out.preempted == [b] and b.num_computed_tokens == 0 and sched.waiting[0] is b
    assert names(out) == [("a", 1)]
    sched.finish(a)
    assert names(step(sched)) == [("b", 8)]  # starts its prompt again, chunked
    assert kv.num_free_blocks == 3


def test_a_victim_is_never_a_sequence_already_in_this_step():
    """Decode-first puts a newer decode before an older prefill; when the prefill then finds no
    block, the newest running sequence (the decode) is already in the step: the prefill must
    give way instead."""
    sched, kv = make(budget=12, num_blocks=4, threshold=6)  # 3 usable blocks
    p, d = seq("p", 20), seq("d", 3)
    sched.add(p)
    sched.add(d)
    assert names(step(sched)) == [("p", 6), ("d", 3)]  # 2 blocks + 1 block: the pool is empty
    out = step(sched)
    assert names(out) == [("d", 1)] and out.preempted == [p]
    assert kv.get_block_ids("d") and not kv.get_block_ids("p")


def test_the_off_switch_needs_the_whole_prompt_in_one_step():
    sched, _ = make(budget=8, chunked=False)
    a, b = seq("a", 6), seq("b", 5)
    sched.add(a)
    sched.add(b)
    assert names(step(sched)) == [("a", 6)]  # b does not fit what is left: it waits whole
    assert names(step(sched)) == [("a", 1), ("b", 5)]
