"""The server's `/metrics`: vLLM's Prometheus metrics, same names, labels, buckets and meanings.

Prometheus scrapes text like `vllm:prompt_tokens_total{engine="0",model_name="m"} 42.0`. Every
metric here carries the labels `model_name` and `engine` (the data-parallel engine index): with DP
one API server exposes all its engines from one registry, one series per engine, and PromQL sums
them (`sum by (model_name)`). Counters are named without the suffix; prometheus_client appends
`_total` on exposition (and a `_created` timestamp).

Gauges (the state after the engine's last step):
  vllm:num_requests_running     sequences in the running batch
  vllm:num_requests_waiting     sequences waiting: queued, swapped out, or their KV still arriving
  vllm:kv_cache_usage_perc      fraction of KV blocks in use, 0..1 (1 means 100 percent); cached
                                blocks nobody holds are free (they are reused on demand)
Counters:
  vllm:prompt_tokens            prompt tokens of requests whose prefill completed (cached included)
  vllm:generation_tokens        tokens generated
  vllm:prefix_cache_queries     prompt tokens looked up in the prefix cache ...
  vllm:prefix_cache_hits        ... and found there: hit rate = rate(hits) / rate(queries)
  vllm:num_preemptions          sequences preempted (their blocks taken back)
  vllm:request_success          finished requests, label finished_reason = stop|length|abort|error
                                (abort: the client went away; a request refused with a 400 never
                                started and counts nowhere)
  with spec_decode: vllm:spec_decode_num_drafts (drafts verified), _num_draft_tokens (tokens
    proposed), _num_accepted_tokens (proposed tokens kept), _num_accepted_tokens_per_pos (label
    position j: drafts whose token j was kept). acceptance rate = accepted / draft tokens; mean
    acceptance length = 1 + accepted / drafts; per-position rate = per_pos[j] / drafts.
  with offload: vllm:kv_offload_store_bytes / _store_time (GPU -> CPU, bytes and seconds spent),
    vllm:kv_offload_load_bytes / _load_time (CPU -> GPU); bandwidth = rate(bytes) / rate(time).
    Gauge vllm:kv_offload_cpu_cache_usage_perc, vLLM's meaning: the fraction of host blocks that
    can be neither handed out nor evicted now (being copied, or lent to a swapped-out sequence);
    0 when idle, however full the host tier is.
Histograms (seconds; one observation per request unless said otherwise):
  vllm:time_to_first_token_seconds     arrival -> first token
  vllm:inter_token_latency_seconds     between consecutive outputs of a request (one per step)
  vllm:e2e_request_latency_seconds     arrival -> finished
  vllm:request_queue_time_seconds      arrival -> first scheduled (WAITING)
  vllm:request_prefill_time_seconds    first scheduled -> first token (PREFILL)
  vllm:request_decode_time_seconds     first token -> last token (DECODE)
  vllm:request_prompt_tokens, vllm:request_generation_tokens   tokens per finished request
  vllm:iteration_tokens_total          prompt + generated tokens per engine step that produced any
A request of n samples counts as n requests (vLLM makes each sample a child request). A
preempted request's second scheduling is not a new start: the time lost counts in its prefill
or decode phase, as in vLLM.

Input (stats.py): the engine sends `SchedulerStats` with counters CUMULATIVE since it started, and
the logger turns them into increments per engine. So a report may be sent twice or skipped and the
counters stay right, and a value that goes down (the engine restarted) counts from zero again.
`IterationStats` are per step and must be sent once; the API process fills them from the outputs
as they arrive, with a `RequestTimer` per completion. Both are recorded before the outputs go to
their handlers, so a client that has its answer finds it in the next scrape.

In vLLM: the metric definitions and `PrometheusStatLogger.record` are in v0.33.0
vllm/v1/metrics/loggers.py (buckets, `build_1_2_5_buckets`); the stats and the phase intervals
in vllm/v1/metrics/stats.py (`IterationStats.update_from_output`, `update_from_finished_request`);
spec decoding's counters in vllm/v1/spec_decode/metrics.py (`SpecDecodingProm`); offload's in
vllm/distributed/kv_transfer/kv_connector/v1/offloading/metrics.py and
vllm/v1/kv_offload/cpu/common.py; the registry, multiprocess mode (PROMETHEUS_MULTIPROC_DIR) and
unregistering in vllm/v1/metrics/prometheus.py; the mount at /metrics in
vllm/entrypoints/serve/instrumentator/metrics.py. vLLM's scheduler counters arrive as per-step
deltas, which a lost message would lose; cumulative totals cannot be lost that way."""
from __future__ import annotations

import re

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .kv_connector import resolve_kv_transfer_config
from .stats import IterationStats, SchedulerStats

FINISH_REASONS = ("stop", "length", "abort", "error")  # vLLM 0.33 also has "repetition"
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
ITERATION_TOKENS_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (the token-count histograms use max_model_len)."""
    buckets, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return buckets
            buckets.append(m * scale)
        scale *= 10


# SchedulerStats cumulative field -> counter name (without vllm: prefix and _total suffix)
_COUNTERS = {"prefix_cache_queries": "prefix_cache_queries",
             "prefix_cache_hits": "prefix_cache_hits", "num_preemptions": "num_preemptions"}
_SPEC_COUNTERS = {"spec_num_drafts": "spec_decode_num_drafts",
                  "spec_num_draft_tokens": "spec_decode_num_draft_tokens",
                  "spec_num_accepted": "spec_decode_num_accepted_tokens"}
_OFFLOAD_COUNTERS = {"offload_load_bytes": "kv_offload_load_bytes",
                     "offload_load_time_s": "kv_offload_load_time",
                     "offload_store_bytes": "kv_offload_store_bytes",
                     "offload_store_time_s": "kv_offload_store_time"}
_HELP = {
    "prefix_cache_queries": "Prefix cache queries, in terms of number of queried tokens.",
    "prefix_cache_hits": "Prefix cache hits, in terms of number of cached tokens.",
    "num_preemptions": "Cumulative number of preemption from the engine.",
    "spec_decode_num_drafts": "Number of spec decoding drafts.",
    "spec_decode_num_draft_tokens": "Number of draft tokens.",
    "spec_decode_num_accepted_tokens": "Number of accepted tokens.",
    "kv_offload_load_bytes": "Total bytes loaded from offload storage to GPU.",
    "kv_offload_load_time": "Total load time from offload storage to GPU, in seconds.",
    "kv_offload_store_bytes": "Total bytes stored from GPU to offload storage.",
    "kv_offload_store_time": "Total store time from GPU to offload storage, in seconds.",
}


class PrometheusStatLogger:
    """One registry for all of a server's engines; `record` takes either or both reports."""
    _labels = ["model_name", "engine"]

    def __init__(self, model_name: str, engine_indexes: list[int],
                 registry: CollectorRegistry | None = None, spec_decode: bool = False,
                 offload: bool = False, *, max_model_len: int = 4096,
                 num_speculative_tokens: int = 0):
        # Our own registry by default, not prometheus_client's global one: two loggers (two
        # servers in one test process) must not clash over the same metric names.
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name, self.engine_indexes = model_name, list(engine_indexes)
        self.spec_decode, self.offload = spec_decode, offload
        self._last: dict[int, dict[str, float]] = {e: {} for e in self.engine_indexes}
        gauge, hist = self._family(Gauge), self._family(Histogram)
        last = {"multiprocess_mode": "mostrecent"}  # only read with PROMETHEUS_MULTIPROC_DIR
        self.running = gauge("num_requests_running",
                             "Number of requests in model execution batches.", **last)
        self.waiting = gauge("num_requests_waiting",
                             "Number of requests waiting to be processed.", **last)
        self.kv_usage = gauge("kv_cache_usage_perc",
                              "KV-cache usage. 1 means 100 percent usage.", **last)
        counter = self._family(Counter)
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens",
                                         "Number of generation tokens processed.")
        self.cumulative = dict(_COUNTERS)
        self.cumulative.update(_SPEC_COUNTERS if spec_decode else {})
        self.cumulative.update(_OFFLOAD_COUNTERS if offload else {})
        self.counters = {name: counter(name, _HELP[name]) for name in self.cumulative.values()}
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          self._labels + ["finished_reason"], registry=self.registry)
        self.request_success = {r: {e: success.labels(model_name, str(e), r)
                                    for e in self.engine_indexes} for r in FINISH_REASONS}
        if spec_decode:  # a series per draft position; more appear if k grows
            self.per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                   "Accepted tokens per draft position.",
                                   self._labels + ["position"], registry=self.registry)
            for e in self.engine_indexes:
                for j in range(num_speculative_tokens):
                    self.per_pos.labels(model_name, str(e), str(j))
        if offload:
            self.cpu_usage = gauge("kv_offload_cpu_cache_usage_perc",
                                   "Fraction of CPU KV-cache blocks neither free nor evictable "
                                   "(in transfer or lent to swapped-out requests).", **last)
        tokens = build_1_2_5_buckets(max_model_len)
        self.ttft = hist("time_to_first_token_seconds",
                         "Histogram of time to first token in seconds.", buckets=TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds",
                        "Histogram of inter-token latency in seconds.", buckets=ITL_BUCKETS)
        in_phase = "Histogram of time spent in {} phase for request."
        phases = {"e2e": ("e2e_request_latency_seconds",
                          "Histogram of e2e request latency in seconds."),
                  "queue": ("request_queue_time_seconds", in_phase.format("WAITING")),
                  "prefill": ("request_prefill_time_seconds", in_phase.format("PREFILL")),
                  "decode": ("request_decode_time_seconds", in_phase.format("DECODE"))}
        self.phase = {key: hist(name, doc, buckets=REQUEST_LATENCY_BUCKETS)
                      for key, (name, doc) in phases.items()}
        self.req_prompt = hist("request_prompt_tokens", "Number of prefill tokens processed.",
                               buckets=tokens)
        self.req_gen = hist("request_generation_tokens", "Number of generation tokens processed.",
                            buckets=tokens)
        self.iter_tokens = hist("iteration_tokens_total",
                                "Histogram of number of tokens per engine_step.",
                                buckets=ITERATION_TOKENS_BUCKETS)

    def _family(self, cls):
        """A maker of one metric family with a child per engine: {engine index: child}."""
        def make(name: str, doc: str, **kwargs):
            metric = cls("vllm:" + name, doc, self._labels, registry=self.registry, **kwargs)
            return {e: metric.labels(self.model_name, str(e)) for e in self.engine_indexes}
        return make

    def _increment(self, engine: int, key: str, total: float) -> float:
        """The increase of a cumulative counter since this engine's last report."""
        last = self._last[engine].get(key, 0)
        self._last[engine][key] = total
        return total - last if total >= last else total  # went down: the engine restarted

    def record(self, scheduler_stats: SchedulerStats | None = None,
               iteration_stats: IterationStats | None = None) -> None:
        if scheduler_stats is not None:
            s, e = scheduler_stats, self._check(scheduler_stats.engine_index)
            self.running[e].set(s.num_running)
            self.waiting[e].set(s.num_waiting)
            self.kv_usage[e].set(s.kv_cache_usage)
            for attr, name in self.cumulative.items():
                self.counters[name][e].inc(self._increment(e, attr, getattr(s, attr)))
            if self.spec_decode:
                for j, total in enumerate(s.spec_accepted_per_pos):
                    self.per_pos.labels(self.model_name, str(e), str(j)).inc(
                        self._increment(e, f"spec_pos_{j}", total))
            if self.offload:
                self.cpu_usage[e].set(s.offload_cpu_usage)
        if iteration_stats is not None:
            it, e = iteration_stats, self._check(iteration_stats.engine_index)
            self.prompt_tokens[e].inc(it.num_prompt_tokens)
            self.generation_tokens[e].inc(it.num_generation_tokens)
            if it.num_prompt_tokens or it.num_generation_tokens:  # not for aborts alone
                self.iter_tokens[e].observe(it.num_prompt_tokens + it.num_generation_tokens)
            for ttft in it.ttfts:
                self.ttft[e].observe(ttft)
            for itl in it.itls:
                self.itl[e].observe(itl)
            for f in it.finished:
                if f.finish_reason not in self.request_success:
                    raise ValueError(f"unknown finish_reason {f.finish_reason!r}")
                self.request_success[f.finish_reason][e].inc()
                for key, value in (("e2e", f.e2e_latency), ("queue", f.queue_time),
                                   ("prefill", f.prefill_time), ("decode", f.decode_time)):
                    self.phase[key][e].observe(value)
                self.req_prompt[e].observe(f.num_prompt_tokens)
                self.req_gen[e].observe(f.num_generation_tokens)

    def _check(self, engine: int) -> int:
        if engine not in self._last:
            raise ValueError(f"engine {engine} is not one of {self.engine_indexes}")
        return engine

    def make_asgi_app(self):
        """The ASGI app serving this registry in Prometheus' text format."""
        return prometheus_client.make_asgi_app(registry=self.registry)


def mount_metrics(app, stat_logger: PrometheusStatLogger) -> None:
    """Serve `stat_logger` at /metrics of a FastAPI/Starlette app. A plain Mount answers
    /metrics with a 307 redirect to /metrics/; widening its pattern serves both, as vLLM does."""
    from starlette.routing import Mount
    route = Mount("/metrics", app=stat_logger.make_asgi_app())
    route.path_regex = re.compile(r"^/metrics(?P<path>.*)$")
    app.routes.append(route)


def attach_stat_logger(client, model_name: str) -> PrometheusStatLogger:
    """A logger for all of an engine client's engines, set as `client.stat_logger`: from then on the
    client records every engine step and every request's timeline. The spec-decode and offload
    families exist only when the engines have them (vLLM registers them the same way)."""
    config = client.config
    kv = resolve_kv_transfer_config(config)
    spec = config.speculative_method is not None
    logger = PrometheusStatLogger(model_name, client.engine_indexes, spec_decode=spec,
                                  offload=kv is not None and kv.kv_connector == "OffloadingConnector",
                                  max_model_len=client.max_model_len,
                                  num_speculative_tokens=config.num_speculative_tokens if spec else 0)
    client.stat_logger = logger
    return logger
