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
use numpy's default linear interpolation (as vLLM does); latencies are reported in ms."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)


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


def compute_serve_metrics(records: Sequence[RequestRecord], duration_s: float,
                          percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> ServeMetrics:
    """Aggregate the per-request records of one benchmark run lasting `duration_s` seconds."""
    ok = [r for r in records if r.success]
    ttfts = [r.ttft for r in ok]
    tpots = [t for t in (request_tpot(r) for r in ok) if t is not None]
    itls = [gap for r in ok for gap in r.itl]
    e2els = [r.latency for r in ok]
    total_in = sum(r.prompt_len for r in ok)  # vLLM counts input of completed requests only
    total_out = sum(r.output_tokens for r in ok)
    dur = max(duration_s, 1e-9)
    return ServeMetrics(
        completed=len(ok), failed=len(records) - len(ok), duration_s=duration_s,
        total_input_tokens=total_in, total_output_tokens=total_out,
        request_throughput=len(ok) / dur, output_throughput=total_out / dur,
        total_token_throughput=(total_in + total_out) / dur,
        ttft_ms=latency_stats(ttfts, percentiles), tpot_ms=latency_stats(tpots, percentiles),
        itl_ms=latency_stats(itls, percentiles), e2el_ms=latency_stats(e2els, percentiles),
        max_concurrent_requests=max_concurrency(records))


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
