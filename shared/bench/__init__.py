"""Benchmarks every part is measured with, as a CLI (`python -m shared.bench ...`) and as
functions returning dataclasses, for notebooks:

    from shared.bench import make_workload, run_throughput, run_serve, run_roofline
    w = make_workload(num_requests=32, input_len="32:256", output_len="16:128", seed=0)
    res = run_throughput("part04_continuous_batching", w)   # ours vs HF baselines
    print(res.table()); res.save_json("throughput.json")

- workload.py    the fixed random-token workload (identical for every system)
- systems.py     a system under test; our engine through its LLM API
- hf_baselines.py  HF generate (static batches) and HF continuous batching
- throughput.py  offline throughput, ratios ours / baseline
- serve.py       OpenAI-compatible streaming load client (vllm bench serve's metrics)
- metrics.py     the metric maths, pure functions
- roofline.py    measured machine peaks, the decode-step and whole-workload lower bounds"""
from .metrics import (LatencyStats, Rates, RequestRecord, ServeMetrics, compute_serve_metrics,
                      latency_stats, request_tpot, throughput_rates)
from .roofline import (MachinePeaks, RooflineResult, StepCost, WorkloadFloor, decode_step_cost,
                       measure_peaks, run_roofline, workload_floor)
from .serve import ServeConfig, ServeResult, run_serve, run_serve_async
from .throughput import SystemResult, ThroughputResult, measure_system, run_throughput
from .workload import BenchRequest, Workload, make_workload, parse_range

__all__ = [
    "BenchRequest", "LatencyStats", "MachinePeaks", "Rates", "RequestRecord", "RooflineResult",
    "ServeConfig", "ServeMetrics", "ServeResult", "StepCost", "SystemResult", "ThroughputResult",
    "Workload", "compute_serve_metrics", "decode_step_cost", "latency_stats", "make_workload",
    "measure_peaks", "measure_system", "parse_range", "request_tpot", "run_roofline", "run_serve",
    "run_serve_async", "run_throughput", "throughput_rates", "WorkloadFloor", "workload_floor",
]
