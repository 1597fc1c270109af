"""What /metrics is made of: the engine's state after a step, and each request's timeline.

Two kinds of numbers, measured in two places, as in vLLM:

* `SchedulerStats`, in the engine: queue lengths, KV-cache usage and the cumulative counters
  (prefix cache, preemptions, spec decoding, host-tier traffic), read from the engine's attributes
  after every step (`make_scheduler_stats`). An engine-core process sends them with its outputs;
  counters are totals since the engine started, so a lost or repeated report changes nothing.
* Per-request timings, in the API process, as the outputs arrive: one `RequestTimer` per
  completion (vLLM makes each of a request's n samples a request of its own) turns "first scheduled",
  "got tokens", "finished" into TTFT, inter-token latencies, the phase durations and token counts.
  The outputs of one engine step fill one `IterationStats`, recorded once.

Clocks: every timer runs on the API process's `time.time()` (arrival is stamped when the request
is validated; an output counts when the API process gets it). The one engine-side event it cannot
see, a completion's first scheduling, is watched after each step (`sequences_not_started`: the
step's start is when it scheduled). An engine in this process (AsyncLLM) reads the same clock; an
engine-core process sends the time in its own clock with the completion's first output, beside the
time it sent that output, and the API maps it as `receive time - (send time - scheduled time)`, so
engines on other hosts need no synchronised clocks (the message's transit counts as zero). vLLM
keeps the phase intervals on the engine clock instead (its EngineCoreEvent timestamps) and only
TTFT and e2e on the API clock; the two agree up to the transit time.

In vLLM: v0.33.0 vllm/v1/metrics/stats.py (SchedulerStats, IterationStats.update_from_output and
update_from_finished_request, RequestStateStats, FinishedRequestStats), vllm/v1/engine/
output_processor.py (the API-side per-request state), vllm/v1/core/sched/scheduler.py
(make_stats) and vllm/v1/engine/__init__.py (EngineCoreEvent, EngineCoreOutputs.timestamp)."""
from __future__ import annotations

from dataclasses import dataclass, field

from .offload_scheduler import OffloadScheduler


@dataclass
class SchedulerStats:
    """The scheduler's state after a step. Counters are cumulative since the engine started."""
    engine_index: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # 0..1
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)
    offload_load_bytes: int = 0
    offload_load_time_s: float = 0.0
    offload_store_bytes: int = 0
    offload_store_time_s: float = 0.0
    offload_cpu_usage: float = 0.0  # a gauge, 0..1: host blocks held by transfers (see below)


def make_scheduler_stats(engine, engine_index: int = 0) -> SchedulerStats:
    """An LLMEngine's SchedulerStats, read from its parts after a step.

    Waiting counts, as vLLM's waiting queue does, sequences admitted whose KV is still arriving
    (`loading`, vLLM's WAITING_FOR_REMOTE_KVS) and sequences swapped out to host memory. The
    prefix-cache counters are the first lookups only (a preempted sequence's second lookup is
    recomputation saved, counted apart by the KV cache manager, as in vLLM)."""
    s, cache = engine.scheduler, engine.prefix_cache_stats
    stats = SchedulerStats(engine_index, len(s.running), len(s.waiting) + len(s.swapped) + len(s.loading),
                           engine.kv_cache_manager.usage, cache.queries, cache.hits, s.num_preemptions)
    spec = engine.spec_decoding_stats
    if spec is not None:
        stats.spec_num_drafts, stats.spec_num_draft_tokens = spec.num_drafts, spec.num_draft_tokens
        stats.spec_num_accepted = spec.num_accepted_tokens
        stats.spec_accepted_per_pos = list(spec.num_accepted_tokens_per_pos)
    if isinstance(engine.connector, OffloadScheduler):
        o = engine.connector.stats
        # Every copy each way: prefix loads and swap-ins; prompt-block stores and swap-outs.
        stats.offload_load_bytes, stats.offload_load_time_s = o.bytes_loaded, o.load_time_s
        stats.offload_store_bytes = o.bytes_stored + o.bytes_swapped_out
        stats.offload_store_time_s = o.store_time_s + o.swap_out_time_s
        stats.offload_cpu_usage = host_blocks_held(engine.connector)
    return stats


def host_blocks_held(connector: OffloadScheduler) -> float:
    """vLLM's kv_offload_cpu_cache_usage_perc: the fraction of host blocks that can be neither
    handed out nor evicted right now, i.e. 1 - (free + evictable) / all. Those are blocks being
    written (a store in flight), blocks being read (pinned by a prefix load) and, ours only, blocks
    lent to swapped-out sequences. 0 when idle however full the tier is: how full it is, is not
    what vLLM reports. Counted from the transfers in flight, not by walking the whole tier."""
    manager = connector.manager
    if not manager.num_blocks:
        return 0.0
    being_read = {h for load in connector.loads.values() for h in load.block_hashes}  # a block may be read twice
    being_written = sum(len(hashes) for _, hashes, _ in connector.stores)
    return (len(being_read) + being_written + len(manager.reserved)) / manager.num_blocks


def sequences_not_started(engine):
    """Running sequences with no token out yet: this step may be their first scheduling. (Emitted
    tokens, not placeholders: with async scheduling a sequence holds one from its last prefill chunk.)"""
    return [seq for seq in engine.scheduler.running if not seq.state.token_ids]


@dataclass
class FinishedRequestStats:
    finish_reason: str  # one of metrics.FINISH_REASONS
    e2e_latency: float = 0.0
    queue_time: float = 0.0
    prefill_time: float = 0.0
    decode_time: float = 0.0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0


@dataclass
class IterationStats:
    """What one engine step produced: per-step amounts, to be recorded exactly once."""
    engine_index: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    ttfts: list[float] = field(default_factory=list)
    itls: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)


@dataclass
class RequestTimer:
    """One completion's timestamps (seconds on one clock, the API process's) -> its stats."""
    arrival: float
    num_prompt_tokens: int
    scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    num_generation_tokens: int = 0
    finished: bool = False

    @classmethod
    def for_request(cls, request) -> list[RequestTimer]:
        """One per completion of an EngineCoreRequest."""
        return [cls(request.arrival_time, len(request.prompt_token_ids))
                for _ in range(request.sampling_params.n)]

    def on_scheduled(self, t: float) -> None:
        if self.scheduled is None:  # re-scheduling after a preemption keeps the first start
            self.scheduled = t

    def on_tokens(self, t: float, num_tokens: int, it: IterationStats) -> None:
        """A step gave this request `num_tokens` (more than 1 with spec decoding): one TTFT or
        one ITL sample per step, not per token, as vLLM."""
        if self.first_token is None:
            self.first_token = t
            it.ttfts.append(t - self.arrival)
            it.num_prompt_tokens += self.num_prompt_tokens  # counted once, when prefill is done
        else:
            it.itls.append(t - self.last_token)
        self.last_token = t
        self.num_generation_tokens += num_tokens
        it.num_generation_tokens += num_tokens

    def on_finished(self, t: float, finish_reason: str, it: IterationStats) -> FinishedRequestStats:
        # A phase that never began lasts 0 and the time goes to the phase the request was in
        # (vLLM leaves such timestamps at 0); queue + prefill + decode = last event - arrival.
        scheduled = t if self.scheduled is None else self.scheduled
        first = t if self.first_token is None else self.first_token
        last = first if self.last_token is None else self.last_token
        stats = FinishedRequestStats(
            finish_reason=finish_reason, e2e_latency=t - self.arrival,
            queue_time=scheduled - self.arrival, prefill_time=first - scheduled,
            decode_time=last - first, num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens)
        it.finished.append(stats)
        self.finished = True
        return stats

    def on_output(self, t: float, num_tokens: int, finish_reason: str | None, it: IterationStats) -> None:
        """One output of the engine for this completion: new tokens, a finish, or both."""
        if num_tokens:
            self.on_tokens(t, num_tokens, it)
        if finish_reason is not None:
            self.on_finished(t, finish_reason, it)

    def on_abort(self, t: float, it: IterationStats) -> None:
        """Its client went away (vLLM's finished_reason "abort"); nothing if it had finished."""
        if not self.finished:
            self.on_finished(t, "abort", it)
