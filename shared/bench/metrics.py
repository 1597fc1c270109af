"""Benchmark maths, as pure functions over timing records (no server, no model), so the
definitions can be read, tested and reused by notebooks.

The serving metrics follow `vllm bench serve` (vllm/benchmarks/serve.py, `calculate_metrics`)
definition for definition, so numbers from this course and from vLLM can be put side by side:
- TTFT  time to first token: request sent -> first chunk that carries tokens.
- TPOT  time per output token, one value per request: (e2e - ttft) / (output_tokens - 1),
        only for requests with more than one output token (the first token is TTFT's).
- ITL   inter-token latency: every gap between consecutive token-carrying chunks, pooled over
        all requests (a chunk carrying k tokens gives one gap, not k).
- E2EL  end-to-end latency: request sent -> last token-carrying chunk.
Statistics are over successful requests; an empty list reports 0 (as vLLM does); percentiles
use numpy's default linear interpolation (as vLLM does); latencies are reported in ms.

Two throughput figures look past the averages:
- goodput (DistServe, arXiv 2401.09670): completed requests per second that met *every* given
  SLO (ttft, tpot, e2el in ms; TPOT per request, 0 for a one-token answer). Throughput counts
  what the server did; goodput counts what the users got in time.
- peak output tokens/s: token-carrying chunks bucketed by the whole second (from the first
  request's start) they arrived in; the fullest bucket. One chunk counts as one token here,
  as in vLLM.

In vLLM: vllm/benchmarks/serve.py (v0.33.0: BenchmarkMetrics, calculate_metrics, parse_goodput)."""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")  # the latency metrics, in report order
SLO_METRICS = ("ttft", "tpot", "e2el")  # per-request metrics a goodput SLO may bound (ITL is per gap)


@dataclass
class RequestRecord:
    """What the load client saw of one request. Times are seconds (time.perf_counter)."""
    prompt_len: int
    expected_output_len: int = 0
    start: float = 0.0  # when the request was sent, on the client's clock
    success: bool = False
    ttft: float = 0.0  # first token-carrying chunk - start
    itl: list[float] = field(default_factory=list)  # gaps between token-carrying chunks
    latency: float = 0.0  # last token-carrying chunk - start (E2EL)
    output_tokens: int = 0  # from the server's usage if it sent one, else the chunk count
    generated_text: str = ""
    error: str = ""


@dataclass
class LatencyStats:
    """Summary of one latency metric, in milliseconds."""
    mean: float
    median: float
    std: float
    p99: float
    percentiles: dict[float, float] = field(default_factory=dict)  # p -> value
    count: int = 0


def latency_stats(values_s: Sequence[float],
                  percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> LatencyStats:
    """Mean/median/std/percentiles of seconds, returned in ms; all zero when there are none."""
    x = np.asarray(values_s if len(values_s) else [0.0], dtype=np.float64) * 1000.0
    pct = {float(p): float(np.percentile(x, p)) for p in percentiles}
    return LatencyStats(mean=float(np.mean(x)), median=float(np.median(x)), std=float(np.std(x)),
                        p99=float(np.percentile(x, 99)), percentiles=pct, count=len(values_s))


def request_tpot(record: RequestRecord) -> float | None:
    """vLLM's per-request TPOT: decode time spread over the tokens after the first."""
    if not record.success or record.output_tokens <= 1:
        return None
    return (record.latency - record.ttft) / (record.output_tokens - 1)


@dataclass
class ServeMetrics:
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (input + output) tokens / s
    ttft_ms: LatencyStats
    tpot_ms: LatencyStats
    itl_ms: LatencyStats
    e2el_ms: LatencyStats
    max_concurrent_requests: int = 0  # the most requests in flight at once, as observed
    max_output_tokens_per_s: float = 0.0  # the fullest one-second bucket of token chunks
    request_goodput: float | None = None  # SLO-meeting requests / s; None: no SLO was given
    good_completed: int | None = None  # how many requests met every SLO


def compute_serve_metrics(records: Sequence[RequestRecord], duration_s: float,
                          percentiles: Sequence[float] = DEFAULT_PERCENTILES,
                          goodput: Mapping[str, float] | None = None) -> ServeMetrics:
    """Aggregate the per-request records of one benchmark run lasting `duration_s` seconds.
    `goodput` maps SLO names (ttft, tpot, e2el) to limits in ms, e.g. parse_goodput's output."""
    ok = [r for r in records if r.success]
    ttfts = [r.ttft for r in ok]
    tpots = [t for t in (request_tpot(r) for r in ok) if t is not None]
    itls = [gap for r in ok for gap in r.itl]
    e2els = [r.latency for r in ok]
    total_in = sum(r.prompt_len for r in ok)  # vLLM counts input of completed requests only
    total_out = sum(r.output_tokens for r in ok)
    dur = max(duration_s, 1e-9)
    good = sum(meets_slos(r, goodput) for r in ok) if goodput else None
    return ServeMetrics(
        completed=len(ok), failed=len(records) - len(ok), duration_s=duration_s,
        total_input_tokens=total_in, total_output_tokens=total_out,
        request_throughput=len(ok) / dur, output_throughput=total_out / dur,
        total_token_throughput=(total_in + total_out) / dur,
        ttft_ms=latency_stats(ttfts, percentiles), tpot_ms=latency_stats(tpots, percentiles),
        itl_ms=latency_stats(itls, percentiles), e2el_ms=latency_stats(e2els, percentiles),
        max_concurrent_requests=max_concurrency(records),
        max_output_tokens_per_s=peak_output_throughput(records),
        request_goodput=None if good is None else good / dur, good_completed=good)


def parse_goodput(pairs: Sequence[str]) -> dict[str, float]:
    """['ttft:200', 'e2el:1000'] -> {'ttft': 200.0, 'e2el': 1000.0}: SLOs in milliseconds."""
    slos: dict[str, float] = {}
    for pair in pairs:
        name, sep, value = pair.partition(":")
        try:
            limit = float(value)
        except ValueError:
            limit = math.nan
        if not sep or math.isnan(limit):
            raise ValueError(f"goodput SLO {pair!r}: want NAME:MILLISECONDS, e.g. ttft:200")
        if name not in SLO_METRICS:
            raise ValueError(f"goodput SLO {pair!r}: the name must be one of {', '.join(SLO_METRICS)}")
        if limit < 0:
            raise ValueError(f"goodput SLO {pair!r}: a limit cannot be negative")
        slos[name] = limit
    return slos


def meets_slos(record: RequestRecord, slos_ms: Mapping[str, float]) -> bool:
    """Did a successful request meet every SLO? A one-token answer has no decode: TPOT 0."""
    values_s = {"ttft": record.ttft, "tpot": request_tpot(record) or 0.0, "e2el": record.latency}
    return record.success and all(values_s[name] <= limit / 1000.0 for name, limit in slos_ms.items())


def peak_output_throughput(records: Sequence[RequestRecord]) -> float:
    """Token-carrying chunks in the busiest whole second (seconds counted from the earliest
    start of a successful request)."""
    ok = [r for r in records if r.success]
    if not ok:
        return 0.0
    t0 = min(r.start for r in ok)
    per_second: Counter[int] = Counter()
    for r in ok:
        arrivals = r.start + r.ttft + np.cumsum([0.0, *r.itl])  # first chunk, then one per gap
        per_second.update(int(t - t0) for t in arrivals)
    return float(max(per_second.values()))


def percentile_key(p: float) -> str:
    """vLLM's name of a percentile in result keys: 99 -> '99', 99.9 -> '99.9'."""
    return str(int(p)) if float(p).is_integer() else str(p)


def vllm_metric_fields(m: ServeMetrics,
                       percentile_metrics: Sequence[str] = PERCENTILE_METRICS) -> dict[str, Any]:
    """The run's figures under the keys `vllm bench serve` writes to its result JSON."""
    out: dict[str, Any] = {
        "duration": m.duration_s, "completed": m.completed, "failed": m.failed,
        "total_input_tokens": m.total_input_tokens, "total_output_tokens": m.total_output_tokens,
        "request_throughput": m.request_throughput, "request_goodput": m.request_goodput,
        "output_throughput": m.output_throughput, "total_token_throughput": m.total_token_throughput,
        "max_output_tokens_per_s": m.max_output_tokens_per_s,
        "max_concurrent_requests": m.max_concurrent_requests}
    for name in percentile_metrics:
        s: LatencyStats = getattr(m, f"{name}_ms")
        out.update({f"mean_{name}_ms": s.mean, f"median_{name}_ms": s.median, f"std_{name}_ms": s.std})
        out.update({f"p{percentile_key(p)}_{name}_ms": v for p, v in s.percentiles.items()})
    return out


def max_concurrency(records: Sequence[RequestRecord]) -> int:
    """The most requests that were in flight at the same instant (start .. start + latency)."""
    events = sorted([(r.start, 1) for r in records if r.success]
                    + [(r.start + r.latency, -1) for r in records if r.success])
    peak = now = 0
    for _, delta in events:  # ends sort before starts at the same instant (-1 < 1)
        now += delta
        peak = max(peak, now)
    return peak


@dataclass
class Rates:
    """Offline throughput figures of one system over one workload."""
    wall_s: float
    requests_per_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float


def throughput_rates(num_requests: int, prompt_tokens: int, output_tokens: int,
                     wall_s: float) -> Rates:
    """Offline throughput as `vllm bench throughput` reports it: everything over wall time."""
    dur = max(wall_s, 1e-9)
    return Rates(wall_s, num_requests / dur, output_tokens / dur,
                 (prompt_tokens + output_tokens) / dur)
