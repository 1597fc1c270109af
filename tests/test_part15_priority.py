"""Part 15's `--scheduling-policy priority`, on the scheduler alone (no model): waiting requests
are admitted by (priority, arrival), lower first; when blocks run out the running request with the
largest (priority, arrival) is preempted, even if it arrived first; fcfs keeps arrival order and
preempts the newest. A non-zero priority under fcfs is a 400 (the InputProcessor's check)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from part15_full.kv_cache_manager import KVCacheManager
from part15_full.request import Sequence
from part15_full.scheduler import Scheduler, SchedulerConfig
from sched_fakes import State, arrive
from shared.sampling_params import SamplingParams

BS = 4


def make(policy: str, num_blocks: int = 64, max_num_seqs: int = 8, budget: int = 256) -> Scheduler:
    kv = KVCacheManager(num_blocks, BS, enable_caching=False)
    return Scheduler(SchedulerConfig(max_num_seqs, budget, policy=policy), kv)


def seq(name: str, prompt_len: int, priority: int, arrival: float, max_tokens: int = 100) -> Sequence:
    request = SimpleNamespace(params=SamplingParams(max_tokens=max_tokens), cache_salt=None,
                              priority=priority, arrival_time=arrival)
    return Sequence(name, request=request, state=State(), token_ids=list(range(prompt_len)))


def step(sched: Scheduler):
    """Schedule and let every sampled token arrive (a synchronous engine)."""
    out = sched.schedule()
    for (s, _), samples in zip(out.scheduled, out.samples):
        if samples:
            arrive(s)
    return out


@pytest.mark.parametrize("policy, order", [("priority", ["urgent", "a", "b", "lazy"]),
                                           ("fcfs", ["lazy", "a", "urgent", "b"])])
def test_waiting_requests_are_admitted_by_priority_then_arrival(policy, order):
    sched = make(policy, max_num_seqs=1)
    for name, prio, t in (("lazy", 5, 0.0), ("a", 0, 1.0), ("urgent", -3, 2.0), ("b", 0, 3.0)):
        sched.add(seq(name, 4, prio, t, max_tokens=1))
    admitted = []
    while sched.has_unfinished():
        out = step(sched)
        for s, _ in out.scheduled:
            if s.seq_id not in admitted:
                admitted.append(s.seq_id)
            if s.num_output_tokens >= 1:  # max_tokens 1: done once its token is in
                s.state.finished = True
                sched.finish(s)
    assert admitted == order


def fill_and_run(policy: str) -> tuple[Scheduler, list[Sequence]]:
    """Three running sequences of 2 blocks each in a pool of 7 usable blocks: the next decode that
    needs a new block preempts one. The first to arrive is the least urgent."""
    sched = make(policy, num_blocks=8)  # one null block: 7 usable
    seqs = [seq("old-lazy", 8, 9, 0.0), seq("mid", 8, 0, 1.0), seq("new-urgent", 8, -1, 2.0)]
    for s in seqs:
        sched.add(s)
    step(sched)  # all three prefill: 6 blocks; each samples its 9th token
    return sched, seqs


@pytest.mark.parametrize("policy, victim", [("priority", "old-lazy"), ("fcfs", "new-urgent")])
def test_blocks_running_out_preempt_the_least_urgent_running_request(policy, victim):
    sched, seqs = fill_and_run(policy)
    out = step(sched)  # every decode needs a third block; only one is left
    assert [s.seq_id for s in out.preempted] == [victim]
    assert sched.waiting[0].seq_id == victim and victim not in [s.seq_id for s in sched.running]
    assert {s.seq_id for s, _ in out.scheduled} == {s.seq_id for s in seqs} - {victim}


def test_a_preempted_request_waits_behind_more_urgent_waiting_ones():
    sched, seqs = fill_and_run("priority")
    sched.add(seq("later-urgent", 4, -5, 3.0))
    sched.add(seq("later-lazy", 4, 20, 4.0))
    step(sched)  # preempts old-lazy (priority 9): it goes between the two newcomers
    assert [s.seq_id for s in sched.waiting] == ["later-urgent", "old-lazy", "later-lazy"]


def test_non_zero_priority_needs_the_priority_policy():
    from part15_full.input_processor import InputProcessor
    from shared.errors import InvalidRequestError

    proc = InputProcessor.__new__(InputProcessor)  # only the policy check runs before tokenizing ids
    proc.scheduling_policy = "fcfs"
    proc.tokenizer = None
    with pytest.raises(InvalidRequestError) as e:
        proc.process_inputs([1, 2, 3], SamplingParams(), priority=1)
    assert e.value.param == "priority"
