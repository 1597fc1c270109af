"""The part 04 scheduler, without a model: FCFS admission, seats and token budget, decode first,
preemption of the newest sequence when blocks run out, static mode, and block accounting."""
from __future__ import annotations

from part04_continuous_batching.kv_cache_manager import KVCacheManager
from part04_continuous_batching.request import Sequence
from part04_continuous_batching.scheduler import Scheduler, SchedulerConfig

BS = 4


def make(num_blocks=32, max_num_seqs=8, max_tokens=64, continuous=True):
    kv = KVCacheManager(num_blocks, BS)
    return Scheduler(SchedulerConfig(max_num_seqs, max_tokens, continuous), kv), kv


def seq(name: str, prompt_len: int) -> Sequence:
    return Sequence(name, request=None, state=None, token_ids=list(range(prompt_len)))


def run_step(sched: Scheduler) -> list[tuple[str, int]]:
    """Schedule, then pretend the model ran: every scheduled sequence is computed and gains a
    token."""
    out = sched.schedule()
    for s, n in out.scheduled:
        s.num_computed_tokens += n
        s.token_ids.append(0)
    return [(s.seq_id, n) for s, n in out.scheduled]


def test_fcfs_admission_prefill_then_decode():
    sched, kv = make()
    a, b = seq("a", 5), seq("b", 3)
    sched.add(a)
    sched.add(b)
    assert run_step(sched) == [("a", 5), ("b", 3)]
    assert run_step(sched) == [("a", 1), ("b", 1)]
    assert kv.get_block_ids("a") and len(kv.get_block_ids("a")) == 2  # 7 tokens / 4 per block


def test_new_requests_join_a_running_batch():
    sched, _ = make()
    sched.add(seq("a", 4))
    run_step(sched)
    sched.add(seq("b", 6))
    assert run_step(sched) == [("a", 1), ("b", 6)]  # decode first, then the new prefill


def test_seat_limit_and_token_budget():
    sched, _ = make(max_num_seqs=2, max_tokens=10)
    for name, n in [("a", 4), ("b", 4), ("c", 1)]:
        sched.add(seq(name, n))
    assert run_step(sched) == [("a", 4), ("b", 4)]  # c waits: no seat
    sched2, _ = make(max_num_seqs=8, max_tokens=10)
    for name, n in [("a", 6), ("b", 6), ("c", 1)]:
        sched2.add(seq(name, n))
    # b does not fit the remaining 4-token budget; FCFS means c does not jump the queue.
    assert run_step(sched2) == [("a", 6)]


def test_preemption_takes_the_newest_and_requeues_it_first():
    # 5 usable blocks (block 0 is the null block) of 4 tokens.
    sched, kv = make(num_blocks=6)
    a, b = seq("a", 8), seq("b", 8)  # 2 blocks each
    sched.add(a)
    sched.add(b)
    run_step(sched)  # both prefilled: 4 blocks used, 9 tokens each now
    assert kv.num_free_blocks == 1
    out = run_step(sched)  # a takes the last block; b cannot grow and is preempted
    assert out == [("a", 1)]
    assert b.num_computed_tokens == 0 and b.num_preemptions == 1 and sched.waiting[0] is b
    assert kv.get_block_ids("b") == [] and sched.num_preemptions == 1
    sched.finish(a)
    assert kv.num_free_blocks == 5
    assert run_step(sched) == [("b", 9)]  # recomputed from its prompt + generated token


def test_a_sequence_that_cannot_grow_preempts_itself_if_newest():
    sched, kv = make(num_blocks=3)  # 2 usable blocks
    a = seq("a", 8)
    sched.add(a)
    run_step(sched)
    out = sched.schedule()
    assert out.scheduled == [] and out.preempted == [a] and kv.num_free_blocks == 2


def test_no_admission_on_a_step_that_preempted():
    sched, kv = make(num_blocks=6)
    a, b = seq("a", 8), seq("b", 8)
    sched.add(a)
    sched.add(b)
    run_step(sched)
    sched.add(seq("c", 1))
    out = sched.schedule()
    assert [s.seq_id for s, _ in out.scheduled] == ["a"] and [s.seq_id for s in out.preempted] == ["b"]
    assert [s.seq_id for s in sched.waiting] == ["b", "c"]


def test_static_mode_admits_only_into_an_empty_batch():
    sched, _ = make(continuous=False)
    a = seq("a", 4)
    sched.add(a)
    run_step(sched)
    sched.add(seq("b", 4))
    assert run_step(sched) == [("a", 1)]
    sched.finish(a)
    assert run_step(sched) == [("b", 4)]


def test_finish_and_abort_free_every_block():
    sched, kv = make()
    seqs = [seq(str(i), 3 + i) for i in range(5)]
    for s in seqs:
        sched.add(s)
    for _ in range(4):
        run_step(sched)
    sched.add(seq("late", 2))  # still waiting: finishing it must work too
    for s in list(sched.running) + list(sched.waiting):
        sched.finish(s)
    assert kv.num_free_blocks == 31 and not kv.req_to_blocks and not sched.has_unfinished()
