"""The part 05 scheduler, without a model: a sequence is advanced when it is scheduled and the
token its step samples is an output placeholder; the step after is scheduled on that
placeholder; no step is scheduled past max_tokens or the model length; a token that arrives
for a sequence finished meanwhile is thrown away; a preempted sequence waits for its token in
flight before it is admitted again."""
from __future__ import annotations

from part05_async_sched.kv_cache_manager import KVCacheManager
from part05_async_sched.request import Sequence
from part05_async_sched.scheduler import Scheduler, SchedulerConfig
from sched_fakes import arrive, make_seq, names

BS = 4


def make(num_blocks=32, max_num_seqs=8, max_tokens=64, max_model_len=None):
    kv = KVCacheManager(num_blocks, BS)
    return Scheduler(SchedulerConfig(max_num_seqs, max_tokens, True, max_model_len), kv), kv


def seq(name: str, prompt_len: int, max_tokens: int | None = 100) -> Sequence:
    return make_seq(Sequence, name, prompt_len, max_tokens)


def test_scheduling_advances_and_counts_a_placeholder():
    sched, _ = make()
    a = seq("a", 5)
    sched.add(a)
    assert names(sched.schedule()) == [("a", 5)]
    assert a.num_computed_tokens == 5 and a.num_output_placeholders == 1
    # The next step is scheduled before the first one's token is known: its input is the
    # placeholder.
    assert names(sched.schedule()) == [("a", 1)]
    assert a.num_computed_tokens == 6 and a.num_output_placeholders == 2 and a.num_tokens == 5
    assert arrive(a) and a.num_output_placeholders == 1 and a.num_tokens == 6
    assert names(sched.schedule()) == [("a", 1)]  # again one token, the new placeholder


def test_update_from_output_discards_a_token_of_a_finished_sequence():
    sched, kv = make()
    a = seq("a", 3)
    sched.add(a)
    out1 = sched.schedule()
    sched.schedule()  # step 2 in flight
    assert sched.update_from_output(out1.scheduled[0][0])  # step 1's token is kept
    a.state.finished = True  # e.g. it was EOS
    sched.finish(a)
    assert not sched.update_from_output(a)  # step 2's token: the sequence is gone
    assert a.num_output_placeholders == 0 and kv.num_free_blocks == 31


def test_no_step_past_max_tokens():
    sched, _ = make()
    a = seq("a", 3, max_tokens=2)
    sched.add(a)
    sched.schedule()  # samples token 1
    assert names(sched.schedule()) == [("a", 1)]  # samples token 2, the last one
    # Both still in flight: a third step could only sample a token past max_tokens.
    assert names(sched.schedule()) == []
    arrive(a)
    assert names(sched.schedule()) == []  # token 2 still in flight: it is the last
    assert a in sched.running  # not finished until its last token arrives


def test_no_step_past_the_model_length():
    sched, _ = make(max_model_len=6)
    a = seq("a", 4, max_tokens=None)
    sched.add(a)
    sched.schedule()  # position 4 sampled -> 5 tokens
    assert names(sched.schedule()) == [("a", 1)]  # samples the 6th, the last position
    assert names(sched.schedule()) == []


def test_a_preempted_sequence_waits_for_its_token_in_flight():
    sched, kv = make(num_blocks=6)  # 5 usable blocks of 4
    a, b = seq("a", 8), seq("b", 8)
    sched.add(a)
    sched.add(b)
    sched.schedule()  # both prefilled: 4 blocks; a token in flight each
    out = sched.schedule()  # a needs a 3rd block for position 8: 1 left; b cannot grow
    assert names(out) == [("a", 1)] and out.preempted == [b]
    assert b.num_computed_tokens == 0 and b.num_output_placeholders == 1
    sched.finish(a)
    assert names(sched.schedule()) == []  # b's token from step 1 has not arrived yet
    arrive(b)
    assert names(sched.schedule()) == [("b", 9)]  # prompt + that token, recomputed


def test_the_off_switch_is_part04_scheduling():
    """With one step in flight (async off) every token arrives before the next schedule, and
    the scheduler makes part 04's decisions."""
    from part04_continuous_batching.scheduler import Scheduler as Scheduler04
    from part04_continuous_batching.scheduler import SchedulerConfig as Config04

    kv5, kv4 = KVCacheManager(8, BS), KVCacheManager(8, BS)
    s5 = Scheduler(SchedulerConfig(3, 64, True, None), kv5)
    s4 = Scheduler04(Config04(3, 64, True), kv4)
    seqs5 = [seq(f"s{i}", 3 + 2 * i) for i in range(5)]
    seqs4 = [seq(f"s{i}", 3 + 2 * i) for i in range(5)]
    for x, y in zip(seqs5, seqs4):
        s5.add(x)
        s4.add(y)
    for step in range(12):
        o5, o4 = s5.schedule(), s4.schedule()
        assert names(o5) == names(o4), step
        assert [s.seq_id for s in o5.preempted] == [s.seq_id for s in o4.preempted]
        for s, n in o4.scheduled:
            s.num_computed_tokens += n
            s.token_ids.append(7)
        for s, _ in o5.scheduled:
            arrive(s)
        for x, y in zip(seqs5, seqs4):
            if len(x.state.token_ids) == 4 and not x.state.finished:  # finish after 4 tokens
                x.state.finished = True
                s5.finish(x)
                s4.finish(y)
    assert kv5.num_free_blocks == kv4.num_free_blocks
