"""Roofline: how fast could a decode step possibly be on this machine, and how close are we?

A step can finish no sooner than its arithmetic takes at the machine's peak FLOP/s, nor sooner
than its memory traffic takes at peak bandwidth: bound = max(FLOPs / peak, bytes / bandwidth).
At decode, every weight is read once per step whatever the batch size, while FLOPs grow with
the batch: at batch 1 a step is a matrix-vector product, memory-bound by far, and the whole
point of batching (parts 04+) is to raise the FLOPs done per weight byte read.

Both peaks are *measured* here (a large GEMM, a large copy) rather than taken from a spec
sheet, and the actual step time is measured through the part's public LLM API.
`workload_floor` applies the same reasoning to a whole benchmark workload: the least time any
engine could take for it here, which the throughput report prints beside the measured systems."""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from shared.config import ModelConfig

from .systems import EngineSystem, LLMSpec, synchronize
from .workload import BenchRequest


@dataclass
class MachinePeaks:
    device: str
    dtype: str
    matmul_flops: float  # FLOP/s of an n x n x n GEMM
    matmul_n: int
    bandwidth: float  # bytes/s of a large device-to-device copy (read + write counted)
    copy_bytes: int

    @property
    def ridge_point(self) -> float:
        """FLOPs per byte above which a kernel is compute-bound rather than memory-bound."""
        return self.matmul_flops / self.bandwidth


def _best_time(fn, repeats: int, device: torch.device) -> float:
    fn()  # first call pays for allocation and kernel selection
    synchronize(device)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best  # the best run: the peak is what the machine *can* do, noise only slows it


def measure_matmul_flops(n: int = 2048, device: str | torch.device = "cpu",
                         dtype: torch.dtype = torch.float32, repeats: int = 5) -> float:
    device = torch.device(device)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    t = _best_time(lambda: torch.matmul(a, b, out=out), repeats, device)
    return 2.0 * n ** 3 / t  # one multiply and one add per inner-product term


def measure_memory_bandwidth(nbytes: int = 256 << 20, device: str | torch.device = "cpu",
                             repeats: int = 5) -> float:
    device = torch.device(device)
    src = torch.empty(nbytes // 4, device=device, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    t = _best_time(lambda: dst.copy_(src), repeats, device)
    return 2.0 * src.nbytes / t  # every byte is read once and written once


def measure_peaks(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                  matmul_n: int = 2048, copy_bytes: int = 256 << 20) -> MachinePeaks:
    return MachinePeaks(str(device), str(dtype).removeprefix("torch."),
                        measure_matmul_flops(matmul_n, device, dtype), matmul_n,
                        measure_memory_bandwidth(copy_bytes, device), copy_bytes)


@dataclass
class StepCost:
    batch_size: int
    context_len: int  # tokens of KV each sequence attends over
    flops: float
    weight_bytes: float
    kv_bytes: float

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes


def linear_params(cfg: ModelConfig) -> int:
    """Weights that take part in a decode step's matmuls: the layers and the LM head (the input
    embedding is a lookup of B rows, negligible; with tied embeddings the head reads it whole)."""
    h, d = cfg.hidden_size, cfg.head_dim
    attn = h * cfg.num_attention_heads * d + 2 * h * cfg.num_key_value_heads * d \
        + cfg.num_attention_heads * d * h
    mlp = 3 * h * cfg.intermediate_size
    return cfg.num_hidden_layers * (attn + mlp) + cfg.vocab_size * h


def decode_step_cost(cfg: ModelConfig, batch_size: int, context_len: int,
                     dtype_bytes: int = 4) -> StepCost:
    """FLOPs and bytes of one decode step: `batch_size` sequences, one new token each, each
    attending over `context_len` cached tokens."""
    params = linear_params(cfg)
    flops = 2.0 * batch_size * params  # each weight: one multiply-add per token
    # Attention: q.K^T and p.V, 2 FLOPs per multiply-add, over every query head.
    flops += 4.0 * batch_size * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * context_len
    weight_bytes = float(params * dtype_bytes)  # read once per step, shared by the whole batch
    # Each sequence reads its own K and V: KV heads only (GQA is what keeps this small).
    kv_bytes = 2.0 * batch_size * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim \
        * context_len * dtype_bytes
    return StepCost(batch_size, context_len, flops, weight_bytes, kv_bytes)


@dataclass
class WorkloadFloor:
    """The least time any engine needs for a whole workload on this machine: every FLOP at the
    measured GEMM peak, or, if longer, its bytes at the measured bandwidth: one full read of the
    weights per step for as many steps as the longest output needs (its tokens come out one step
    at a time), and each decode token's read of its sequence's cached K and V (decode_step_cost
    counts both in a step)."""
    flops: float
    compute_s: float
    min_steps: int
    memory_s: float
    kv_bytes: float = 0.0  # the decode tokens' reads of cached K/V, in memory_s

    @property
    def bound_s(self) -> float:
        return max(self.compute_s, self.memory_s)


def workload_floor(cfg: ModelConfig, peaks: MachinePeaks, prompt_lens: Sequence[int],
                   output_lens: Sequence[int], dtype_bytes: int = 4) -> WorkloadFloor:
    """A request with p prompt and o output tokens feeds p + o - 1 tokens through the layers
    (the last output is never fed back), applies the LM head o times, and its token at position
    i attends over i + 1 keys. Its o - 1 decode tokens (positions p .. p + o - 2; the first output
    comes from the prefill) each read the K and V of the i tokens before them from the cache; a
    prompt's tokens are attended as they are made and read nothing cached."""
    head = cfg.vocab_size * cfg.hidden_size
    layers = linear_params(cfg) - head
    attn_per_key = 4.0 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim
    kv_per_token = decode_step_cost(cfg, 1, 1, dtype_bytes).kv_bytes  # one cached token's K and V, every layer
    flops = cached = 0.0
    for p, o in zip(prompt_lens, output_lens):
        fed = p + o - 1
        flops += 2.0 * (fed * layers + o * head) + attn_per_key * fed * (fed + 1) / 2
        cached += (o - 1) * p + (o - 1) * (o - 2) / 2 if o > 1 else 0  # the sum of i over p .. p + o - 2
    steps = max(output_lens, default=0)
    kv_bytes = cached * kv_per_token
    memory = (steps * linear_params(cfg) * dtype_bytes + kv_bytes) / peaks.bandwidth
    return WorkloadFloor(flops, flops / peaks.matmul_flops, steps, memory, kv_bytes)


@dataclass
class RooflineRow:
    batch_size: int
    context_len: int
    flops: float
    bytes: float
    compute_s: float  # flops / peak FLOP/s
    memory_s: float  # bytes / peak bandwidth
    bound_s: float  # max of the two: no step can be faster
    measured_s: float | None = None  # time to advance all batch_size sequences by one token

    @property
    def efficiency(self) -> float | None:
        """bound / measured: 1.0 would be running at the roofline."""
        return None if not self.measured_s else self.bound_s / self.measured_s


def bound_row(cfg: ModelConfig, peaks: MachinePeaks, batch_size: int, context_len: int,
              dtype_bytes: int) -> RooflineRow:
    c = decode_step_cost(cfg, batch_size, context_len, dtype_bytes)
    compute, memory = c.flops / peaks.matmul_flops, c.bytes / peaks.bandwidth
    return RooflineRow(batch_size, context_len, c.flops, c.bytes, compute, memory, max(compute, memory))


def measure_decode_step(system: EngineSystem, pool: Sequence[int], batch_size: int,
                        prompt_len: int, decode_tokens: int, repeats: int = 2) -> float:
    """Time to advance `batch_size` sequences by one token, through the public API: generate
    1 token, then 1 + k tokens, for the same prompts; prefill costs cancel in the difference,
    leaving k decode steps. A part that batches does them together (one step per token); a
    part that serves one request at a time (part 01) does B times as many steps."""
    prompts = [[pool[(b * 7919 + i * 31) % len(pool)] for i in range(prompt_len)]
               for b in range(batch_size)]  # distinct, deterministic prompts

    def run(n: int) -> float:
        reqs = [BenchRequest(p, n) for p in prompts]
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            system.generate(reqs)
            synchronize()
            best = min(best, time.perf_counter() - t0)
        return best

    return max(run(1 + decode_tokens) - run(1), 0.0) / decode_tokens


@dataclass
class RooflineResult:
    peaks: MachinePeaks
    model: dict[str, Any]
    rows: list[RooflineRow] = field(default_factory=list)

    def table(self) -> str:
        return format_roofline(self)

    def to_dict(self) -> dict[str, Any]:
        return {"peaks": {**asdict(self.peaks), "ridge_point": self.peaks.ridge_point},
                "model": self.model,
                "rows": [{**asdict(r), "efficiency": r.efficiency} for r in self.rows]}

    def save_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2))


def run_roofline(llm: LLMSpec, batch_sizes: Sequence[int] = (1, 2, 4, 8), prompt_len: int = 64,
                 decode_tokens: int = 16, *, model: str | None = None, device: str | None = None,
                 dtype: str | None = None, engine_kwargs: dict[str, Any] | None = None,
                 measure: bool = True) -> RooflineResult:
    """Measure the machine's peaks, then the engine's decode step time at each batch size,
    beside the roofline bound for that step."""
    from shared.device import resolve_device, resolve_dtype
    from shared.weights import load_config, resolve_model_path

    from .workload import model_token_pool

    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    path = resolve_model_path(model)
    cfg = load_config(path)
    dtype_bytes = dt.itemsize
    peaks = measure_peaks(dev, dt)
    # KV length averaged over the k decode steps (it grows by one per step).
    context = prompt_len + (decode_tokens + 1) // 2
    rows = [bound_row(cfg, peaks, b, context, dtype_bytes) for b in batch_sizes]
    if measure:
        system = EngineSystem(llm, model=model, device=device, dtype=dtype, engine_kwargs=engine_kwargs)
        system.load()
        try:
            pool, _ = model_token_pool(path)
            # Warm-up at the measured prompt length, so no first-call cost lands in batch 1.
            system.generate([BenchRequest(list(pool[:prompt_len]), 1 + decode_tokens)])
            for row in rows:
                row.measured_s = measure_decode_step(system, pool, row.batch_size, prompt_len, decode_tokens)
        finally:
            system.close()
    info = {"path": str(path), "linear_params": linear_params(cfg), "dtype_bytes": dtype_bytes,
            "weight_bytes": linear_params(cfg) * dtype_bytes, "prompt_len": prompt_len,
            "decode_tokens": decode_tokens, "engine": llm if isinstance(llm, str) else type(llm).__name__}
    return RooflineResult(peaks, info, rows)


def format_roofline(res: RooflineResult) -> str:
    p, m = res.peaks, res.model
    lines = [f"machine: {p.device} {p.dtype}: matmul {p.matmul_flops / 1e9:.1f} GFLOP/s "
             f"({p.matmul_n}^3 GEMM), copy bandwidth {p.bandwidth / 1e9:.1f} GB/s, "
             f"ridge point {p.ridge_point:.1f} FLOP/byte",
             f"model: {m['linear_params'] / 1e6:.1f} M matmul weights = {m['weight_bytes'] / 1e6:.0f} MB "
             f"read per step; prompt {m['prompt_len']} + {m['decode_tokens']} decode tokens "
             f"(engine: {m['engine']})"]
    head = (f"{'batch':>5} {'ctx':>5} {'GFLOP':>7} {'MB':>7} {'FLOP/B':>7} {'compute ms':>10} "
            f"{'memory ms':>10} {'bound ms':>9} {'measured ms':>12} {'per tok ms':>10} {'bound/meas':>10}")
    lines += [head, "-" * len(head)]
    for r in res.rows:
        meas = "-" if r.measured_s is None else f"{r.measured_s * 1e3:.2f}"
        per_tok = "-" if r.measured_s is None else f"{r.measured_s * 1e3 / r.batch_size:.2f}"
        eff = "-" if r.efficiency is None else f"{r.efficiency:.0%}"
        lines.append(f"{r.batch_size:>5} {r.context_len:>5} {r.flops / 1e9:>7.2f} {r.bytes / 1e6:>7.1f} "
                     f"{r.flops / r.bytes:>7.1f} {r.compute_s * 1e3:>10.2f} {r.memory_s * 1e3:>10.2f} "
                     f"{r.bound_s * 1e3:>9.2f} {meas:>12} {per_tok:>10} {eff:>10}")
    lines.append("measured = time to advance every sequence of the batch by one token "
                 "(difference of two generate calls); bound = max(compute, memory)")
    return "\n".join(lines)
