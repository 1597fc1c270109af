"""The scheduler: which sequences run in the next step, and how many tokens each.

Plain Python over two queues, testable without a model (vLLM V1's shape). Every step has a token
budget, `max_num_batched_tokens`, and a prompt longer than what is left of it is split into
chunks over several steps (chunked prefill):
  1. running sequences that decode, oldest first, one token each (decode-first: a long prompt
     never stalls the streams already running). Each needs a KV slot for it; when the pool has
     no block left, the newest running sequence is preempted (with the `priority` policy: the one
     with the largest (priority, arrival), lower values being more urgent, as vLLM's): its blocks are freed, its progress
     forgotten (num_computed_tokens = 0), and it goes back to the front of `waiting`, to be
     recomputed later from its prompt plus the tokens it had already generated (its freed
     full blocks stay in the prefix cache until reused, so a resume often finds most of them);
  2. running sequences still part-way through their prompt, their next chunk;
  3. waiting sequences in FCFS order (or, with the `priority` policy, by (priority, arrival)), while there is a free seat (max_num_seqs), budget for at
     least one token, and blocks for their first chunk. A sequence's first step starts after
     the longest run of its leading blocks found in the prefix cache (part 07): those tokens
     cost neither budget nor compute, only the rest is chunked.
A chunk is what is left of the budget, at most `long_prefill_token_threshold` (when set) so that
one huge prompt cannot take a whole step. Only the step that computes a sequence's last known
token samples: a chunk that ends earlier produces logits nobody needs.

Async scheduling (part 05): the step being scheduled may start before the previous step's sampled
tokens reach the host. So a sequence is advanced when it is *scheduled* (`num_computed_tokens +=
its new tokens`), and the token its step will sample is counted as an output placeholder: a
sequence's new tokens are `num_tokens + num_output_placeholders - num_computed_tokens`, which
for a decode behind a step in flight is 1, the placeholder itself. `update_from_output` turns
placeholders into real tokens once they arrive.

Speculative decoding (part 08): a decoding sequence may carry draft tokens (`spec_token_ids`,
proposed before this schedule). Its step then computes its newest token plus the drafts, so the
target scores all of them in one pass; the budget may cut the drafts short, never the newest
token. After the step, the rejected drafts' positions are given back (`num_computed_tokens` rolls
back): their K/V slots hold guesses and are overwritten later.

A KV connector (part 13, kv_connector.py; part 12's host tier is one) moves KV blocks in and out of
the pool. At admission, after the device's prefix hit, the connector says how many more tokens it can
supply: a synchronous connector's load happens in this step (they count as computed at once); an
asynchronous one's sequence waits in `loading` (vLLM's WAITING_FOR_REMOTE_KVS), holding its blocks and
a seat, computing nothing, until the workers report the load done (or failed: then
`kv_load_failure_policy` recomputes it or fails it). A finished sequence whose connector still sends
its KV somewhere keeps its blocks in `sending` until that is reported done. With the offloading
connector, `--preemption-mode swap` adds `swapped`: preempted sequences whose KV went to host memory,
back before new prompts, through `loading`. Without a connector all three stay empty and every step
is part 11's."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from .kv_cache_manager import KVCacheManager
from .kv_connector import KVConnectorBase, KVConnectorOutput
from .request import Sequence


@dataclass
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    continuous_batching: bool = True  # off: admit only into an empty batch (static batching)
    max_model_len: int | None = None  # with it, no step is scheduled past a sequence's end
    enable_chunked_prefill: bool = True  # off: a prompt must fit in one step (part 05)
    long_prefill_token_threshold: int = 0  # most tokens of one prompt per step (0: no limit)
    preemption_mode: str = "recompute"  # or "swap": a victim's KV goes to the host tier (part 12)
    # "fcfs", or "priority": waiting by (priority, arrival), the running sequences in that order too,
    # so the victim (the last one not yet scheduled) is the least urgent. vLLM: SchedulingPolicy.
    policy: str = "fcfs"
    # Part 15's pipeline (pipeline.py): PP steps in flight, each with sequences the others do not hold
    # (a sequence's next input is the token its step in flight samples) and at most max_num_seqs / PP.
    pipeline_parallel_size: int = 1

    @property
    def max_seqs_per_step(self) -> int:
        return -(-self.max_num_seqs // self.pipeline_parallel_size)


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, new tokens)
    preempted: list[Sequence] = field(default_factory=list)
    samples: list[bool] = field(default_factory=list)  # per scheduled: does its step sample?
    spec_token_ids: list[list[int]] = field(default_factory=list)  # per scheduled: drafts verified
    # Finished or aborted since the last step: worker processes drop their state for these.
    finished_seq_ids: list[str] = field(default_factory=list)
    # What a KV connector's scheduler side sends its worker side with this step (parts 12-13).
    kv_connector_metadata: Any = None

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 connector: KVConnectorBase | None = None, kv_load_failure_policy: str = "fail"):
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.connector = connector
        self.kv_load_failure_policy = kv_load_failure_policy
        if config.preemption_mode == "swap" and not hasattr(connector, "swap_out"):
            raise ValueError("--preemption-mode swap needs a host tier: set --kv-offloading-size")
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()  # KV in host memory, waiting for device blocks
        self.loading: dict[str, tuple[Sequence, int]] = {}  # KV on its way: (sequence, computed once in)
        self.sending: dict[str, Sequence] = {}  # finished; blocks kept until the connector has sent them
        self.num_preemptions = 0
        self.finished_seq_ids: list[str] = []

    def add(self, seq: Sequence) -> None:
        if self.config.policy == "priority":
            self._insert_waiting(seq)
        else:
            self.waiting.append(seq)

    @staticmethod
    def priority_key(seq: Sequence) -> tuple[int, float]:
        return seq.request.priority, seq.request.arrival_time

    def _insert_waiting(self, seq: Sequence) -> None:
        """Into `waiting` by (priority, arrival), after its equals (a preempted sequence goes back to
        its place, not to the front). vLLM keeps a heap (PriorityRequestQueue)."""
        key = self.priority_key(seq)
        at = next((i for i, s in enumerate(self.waiting) if self.priority_key(s) > key), len(self.waiting))
        self.waiting.insert(at, seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or self.loading)

    @staticmethod
    def num_new_tokens(seq: Sequence) -> int:
        return seq.num_tokens + seq.num_output_placeholders + len(seq.spec_token_ids) - seq.num_computed_tokens

    @classmethod
    def is_prefilling(cls, seq: Sequence) -> bool:
        """Still computing its prompt (or, after a preemption, prompt and earlier output) rather
        than decoding its newest token (and its drafts)."""
        return cls.num_new_tokens(seq) - len(seq.spec_token_ids) > 1 or seq.num_output_tokens == 0

    def _reaches_its_end(self, seq: Sequence) -> bool:
        """The token in flight is the sequence's last one (max_tokens or the model length): one
        more step would sample a token that can only be thrown away, so do not schedule it."""
        if not seq.num_output_placeholders:
            return False
        max_tokens = seq.request.params.max_tokens
        if max_tokens is not None and seq.num_output_tokens >= max_tokens:
            return True
        limit = self.config.max_model_len
        return limit is not None and seq.num_tokens + seq.num_output_placeholders >= limit

    def _chunk(self, seq: Sequence, budget: int, num_hit_tokens: int = 0) -> int:
        """How many of the sequence's new tokens (those past a cache hit) fit in this step."""
        num_new = self.num_new_tokens(seq) - num_hit_tokens
        if not self.config.enable_chunked_prefill and not seq.spec_token_ids:
            return num_new if num_new <= budget else 0
        if self.config.long_prefill_token_threshold > 0:
            num_new = min(num_new, self.config.long_prefill_token_threshold)
        return min(num_new, budget)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if self.swapped:
            self._schedule_swapped(out)
        self._schedule_waiting(out, budget)
        self._advance(out)
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
        if out.scheduled:  # the workers hear of finished sequences with the next step
            out.finished_seq_ids, self.finished_seq_ids = self.finished_seq_ids, []
        return out

    def _seats_taken(self) -> int:
        return len(self.running) + len(self.loading)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Step 1: the running sequences (preempting the newest when blocks run out); returns the
        budget left."""
        kv = self.kv_cache_manager
        # Oldest first: the decodes, then the partly prefilled ones.
        decodes, prefills = [], []
        running = sorted(self.running, key=self.priority_key) if self.config.policy == "priority" else self.running
        for s in running:
            (prefills if self.is_prefilling(s) else decodes).append(s)
        taken: set[str] = set()  # scheduled in this step: never a preemption victim
        gone: set[str] = set()  # preempted earlier in this loop
        pipelined = self.config.pipeline_parallel_size > 1
        for seq in decodes + prefills:
            if seq.seq_id in gone or self._reaches_its_end(seq) or (pipelined and seq.num_output_placeholders):
                continue  # preempted already, done once its last token lands, or (pipelined) in flight
            if len(out.scheduled) >= self.config.max_seqs_per_step:
                break
            num_new = self._chunk(seq, budget)
            if num_new == 0:
                if budget == 0:
                    break
                continue  # chunking off: this prompt waits for a step with room for all of it
            while not kv.allocate_slots(seq, seq.num_computed_tokens + num_new):
                # The newest running sequence not yet in this step (`seq` itself at worst); with
                # priorities, the least urgent one.
                victim = next(s for s in reversed(self.running) if s.seq_id not in taken) \
                    if self.config.policy != "priority" else \
                    max((s for s in self.running if s.seq_id not in taken), key=self.priority_key)
                self.running.remove(victim)
                gone.add(victim.seq_id)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.scheduled.append((seq, num_new))
                taken.add(seq.seq_id)
                budget -= num_new
                del seq.spec_token_ids[max(num_new - 1, 0):]  # drafts past the budget wait
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Step 2: admit waiting sequences while seats, budget and blocks last."""
        kv = self.kv_cache_manager
        # FCFS; none on a step that had to preempt (memory is short). A sequence preempted with a
        # token still in flight waits for that token first. One whose connector says "ask again"
        # keeps its place, and the next one is considered.
        admit = not out.preempted and (self.config.continuous_batching or not self.running)
        deferred: list[Sequence] = []
        while admit and self.waiting and self._seats_taken() < self.config.max_num_seqs and budget > 0 \
                and len(out.scheduled) < self.config.max_seqs_per_step:
            seq = self.waiting[0]
            if seq.num_output_placeholders:
                break
            # Its first step (new, or resumed after a preemption): start after a cache hit.
            # Part 15: a request with prompt logprobs computes every position (no hit, no external load).
            skip = getattr(seq, "skip_reading_prefix_cache", False)
            hit_blocks, num_hit = ([], 0) if skip else kv.get_computed_blocks(seq)
            external, is_async = (0, False) if self.connector is None or skip else \
                self.connector.get_num_new_matched_tokens(seq, num_hit)
            if external is None:  # the connector cannot tell yet
                deferred.append(self.waiting.popleft())
                continue
            if external and is_async:
                if not kv.allocate_slots(seq, num_hit + external, hit_blocks, cache=False):
                    break
                self._wait_for_kv(seq, num_hit, external)
                continue
            num_new = self._chunk(seq, budget, num_hit + external)
            if num_new == 0 or not kv.allocate_slots(seq, num_hit + external + num_new, hit_blocks):
                break
            seq.num_computed_tokens = num_hit
            if self.connector is not None:  # a synchronous load: in this step, before the forward
                self.connector.update_state_after_alloc(seq, kv.get_block_ids(seq.seq_id), external)
            seq.num_computed_tokens = num_hit + external
            self.waiting.popleft()
            self.running.append(seq)
            out.scheduled.append((seq, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(deferred))

    def _wait_for_kv(self, seq: Sequence, num_hit: int, external: int) -> None:
        """Admitted with its blocks; its external tokens arrive asynchronously: it waits in `loading`."""
        seq.num_computed_tokens = num_hit
        self.connector.update_state_after_alloc(seq, self.kv_cache_manager.get_block_ids(seq.seq_id), external)
        self.waiting.popleft()
        self.loading[seq.seq_id] = (seq, num_hit + external)

    def _schedule_swapped(self, out: SchedulerOutput) -> None:
        """Swapped sequences come back before new prompts, oldest first, when the pool has their
        blocks (never on a step that had to preempt): fresh device blocks, then a load from host."""
        kv = self.kv_cache_manager
        while not out.preempted and self.swapped and self._seats_taken() < self.config.max_num_seqs:
            seq = self.swapped[0]
            if seq.num_output_placeholders or not kv.allocate_slots(seq, seq.num_computed_tokens, cache=False):
                break  # its last token is still in flight, or the pool is short: it waits its turn
            self.swapped.popleft()
            self.connector.swap_in(seq)
            self.loading[seq.seq_id] = (seq, seq.num_computed_tokens)

    def update_from_kv_connector(self, output: KVConnectorOutput) -> list[Sequence]:
        """A step's report of finished transfers: arrived KV puts its sequence to work (or, if it was
        aborted meanwhile, lets its blocks go); a failed load is recomputed or failed, by policy;
        sent KV frees its finished sequence's blocks. Returns the sequences failed by policy."""
        self.connector.update_connector_output(output)
        failed = []
        for seq_id in output.finished_recving | output.failed_recving:
            seq, computed = self.loading.pop(seq_id)
            if seq.finished:  # aborted while its KV was arriving: the blocks are free to go now
                self._release(seq)
                continue
            if seq_id in output.failed_recving:
                if self.kv_load_failure_policy == "fail":
                    failed.append(seq)
                    continue
                # recompute: keep what the device had, compute the rest as a prefill
                computed = seq.num_computed_tokens
            seq.num_computed_tokens = computed
            self.running.append(seq)
        for seq_id in output.finished_sending:
            if seq_id in self.sending:
                self._release(self.sending.pop(seq_id))
        return failed

    def _release(self, seq: Sequence) -> None:
        self.kv_cache_manager.free(seq.seq_id)
        self.finished_seq_ids.append(seq.seq_id)

    def _advance(self, out: SchedulerOutput) -> None:
        """Step 3: the step is as good as run: advance every scheduled sequence now. One whose step
        computes its last known token samples: count that token as a placeholder until its id
        reaches the host. A chunk that stops short of the end samples nothing."""
        for seq, num_new in out.scheduled:
            seq.num_computed_tokens += num_new
            spec, seq.spec_token_ids = seq.spec_token_ids, []  # the step takes them
            samples = seq.num_computed_tokens == seq.num_tokens + seq.num_output_placeholders + len(spec)
            seq.num_output_placeholders += samples
            out.samples.append(samples)
            out.spec_token_ids.append(spec)

    def update_from_output(self, seq: Sequence, num_rejected: int = 0) -> bool:
        """The sampled tokens of `seq` have reached the host. Returns True when they are to be
        kept; False when the sequence finished (or was aborted) after its step was scheduled:
        the step in flight ran for nothing, and its tokens are thrown away. Rejected drafts give
        their positions back: the next step recomputes from the first rejected one."""
        seq.num_output_placeholders -= 1
        seq.num_computed_tokens -= num_rejected
        return not seq.finished

    def _preempt(self, seq: Sequence) -> None:
        seq.spec_token_ids = []
        seq.num_preemptions += 1
        self.num_preemptions += 1
        if self.config.preemption_mode == "swap" and self.connector.swap_out(seq):
            self.kv_cache_manager.free(seq.seq_id)  # reusable now: the copy runs before this step's forward
            self.swapped.append(seq)  # its progress is kept
            return
        self.kv_cache_manager.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.num_draft_computed = None
        if self.config.policy == "priority":
            self._insert_waiting(seq)
        else:
            self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Take a finished (or aborted) sequence out of the queues and free its blocks. One whose
        KV is arriving keeps its blocks until the load is done (the copy is writing them); one whose
        connector still sends its KV keeps them until that is done (update_from_kv_connector)."""
        if seq.seq_id in self.loading:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.swapped:
            self.swapped.remove(seq)
            self.connector.drop_swapped(seq)
        if self.connector is not None:
            delay, seq.kv_transfer_params = self.connector.request_finished(
                seq, self.kv_cache_manager.get_block_ids(seq.seq_id))
            if delay:
                self.sending[seq.seq_id] = seq
                return
        self._release(seq)
