"""The scheduler: which sequences run in the next step, and how many tokens each.

Plain Python over two queues, testable without a model (vLLM V1's shape):
  * running sequences go first, one token each (decode); each needs a KV slot for it. When the
    pool has no block left, the newest running sequence is preempted: its blocks are freed, its
    progress forgotten (num_computed_tokens = 0), and it goes back to the front of `waiting`, to
    be recomputed later from its prompt plus the tokens it had already generated;
  * then waiting sequences are admitted in FCFS order while the step has room: a free seat
    (max_num_seqs), token budget for the whole prompt (max_num_batched_tokens) and blocks for it.
Prefills and decodes of one step are run together in one flattened batch."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .kv_cache_manager import KVCacheManager
from .request import Sequence


@dataclass
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    continuous_batching: bool = True  # off: admit only into an empty batch (static batching)


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, new tokens)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager):
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        kv = self.kv_cache_manager

        # 1. Running sequences, oldest first.
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            num_new = seq.num_tokens - seq.num_computed_tokens
            if num_new > budget:
                break
            while not kv.allocate_slots(seq.seq_id, seq.num_tokens):
                victim = self.running.pop()  # the newest
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.scheduled.append((seq, num_new))
                budget -= num_new
                i += 1
                continue
            break  # `seq` preempted itself: it was the newest, nothing after it is left

        # 2. Waiting sequences, FCFS; none on a step that had to preempt (memory is short).
        admit = not out.preempted and (self.config.continuous_batching or not self.running)
        while admit and self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            num_new = seq.num_tokens - seq.num_computed_tokens
            if num_new > budget or not kv.allocate_slots(seq.seq_id, seq.num_tokens):
                break
            self.waiting.popleft()
            self.running.append(seq)
            out.scheduled.append((seq, num_new))
            budget -= num_new
        return out

    def _preempt(self, seq: Sequence) -> None:
        self.kv_cache_manager.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Take a finished (or aborted) sequence out of the queues and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv_cache_manager.free(seq.seq_id)
