"""Where a decode step's time goes: the torch profiler over steady decoding.

`python -m shared.bench.step_profile --part part15_full --model DIR --load-format dummy --batch 64
--engine-arg enforce_eager=True --json out.json` profiles `batch` requests of `prompt_len` tokens
generating `steps` tokens each, all in one batch (after a warm-up run), so all but the first
steps are decodes of the whole batch, and reports per engine step: the wall time,
the time the device spent in kernels, the kernel launches (and CUDA-graph launches) the host made,
and the host-device synchronizations. On a GPU a step whose wall time is many times its kernel
time is bound by the host; CUDA graphs turn a step's hundreds of launches into a few.
On a CPU it runs too (no device events), which is how the GPU script is dry-run.

The sync audit: every engine step runs under a profiler label, so each sync (and launch) is counted
in the step it happened in, and `syncs_per_decode_step` is the median over the steps that
scheduled decodes only (the prompt step excluded). `--temperature 0,1.0 --top-p 1.0,0.9` profiles
each sampling setting in turn on one engine (greedy, then random sampling with top-p: the
sampler's paths differ). `--sync-sources` adds one more run per setting under
`torch.cuda.set_sync_debug_mode("warn")` and names the lines of this repository that
synchronized (the innermost frame of part*/ or shared/ in each warning's stack), with counts per
engine step."""
from __future__ import annotations

import argparse
import bisect
import importlib
import json
import statistics
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Host calls that wait for the device. A blocking copy (.item(), .tolist(), .cpu(), a pageable
# copy in either direction) shows as cudaMemcpyAsync followed by cudaStreamSynchronize.
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel")
STEP_LABEL = "step_profile.engine_step"


def profile_decode(part: str, model: str | None, batch: int, steps: int, prompt_len: int, device: str | None,
                   dtype: str | None, load_format: str, engine_args: dict, temperature: float = 0.0,
                   top_p: float = 1.0, sync_sources: bool = False) -> dict:
    """One sampling setting; profile_decodes profiles several on one engine."""
    return profile_decodes(part, model, batch, steps, prompt_len, device, dtype, load_format, engine_args,
                           [(temperature, top_p)], sync_sources)[0]


def profile_decodes(part: str, model: str | None, batch: int, steps: int, prompt_len: int, device: str | None,
                    dtype: str | None, load_format: str, engine_args: dict,
                    settings: list[tuple[float, float]], sync_sources: bool = False) -> list[dict]:
    import torch

    llm = importlib.import_module(part).LLM(model=model, device=device, dtype=dtype, load_format=load_format,
                                            max_num_seqs=max(batch, 1), **engine_args)
    try:
        on_cuda = torch.cuda.is_available() and (device or "cuda").startswith("cuda")
        prompts = [{"prompt_token_ids": [(7 * i + j) % 100 + 3 for j in range(prompt_len)]} for i in range(batch)]
        return [{"part": part, "engine_args": engine_args}
                | _profile_one(llm, prompts, steps, temperature, top_p, on_cuda, sync_sources)
                for temperature, top_p in settings]
    finally:
        getattr(llm, "shutdown", lambda: None)()


def _profile_one(llm, prompts, steps: int, temperature: float, top_p: float, on_cuda: bool,
                 sync_sources: bool) -> dict:
    import torch
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile

    from shared.sampling_params import SamplingParams

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=temperature, top_p=top_p, max_tokens=n, ignore_eos=True)

    llm.generate(prompts, params(4))  # warm-up, with this setting's sampler path
    getattr(llm, "reset_prefix_cache", lambda: None)()
    engine = llm.engine
    step, schedule = engine.step, engine.scheduler.schedule
    # Per engine step: did it schedule decodes only (every scheduled sequence one new token)?
    decode_only: list[bool] = []

    def observed_schedule(*args, **kwargs):
        out = schedule(*args, **kwargs)
        if out.scheduled and decode_only:
            decode_only[-1] = all(n == 1 for _, n in out.scheduled)
        return out

    def labelled_step():
        decode_only.append(False)  # a step that schedules nothing (it only reads tokens) is not counted
        with record_function(STEP_LABEL):
            return step()
    engine.step, engine.scheduler.schedule = labelled_step, observed_schedule
    try:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
        if on_cuda:
            torch.cuda.synchronize()
        # One prompt step (or a few chunks), then `steps` decode steps of the whole batch.
        with profile(activities=activities, **_all_threads()) as prof:
            start = time.perf_counter()
            llm.generate(prompts, params(steps))
            with record_function("step_profile.final_sync"):
                if on_cuda:
                    torch.cuda.synchronize()
            wall = time.perf_counter() - start
        num_steps = len(decode_only)
        sources = _sync_sources(llm, prompts, params(steps), decode_only, on_cuda) if sync_sources else None
    finally:
        engine.step, engine.scheduler.schedule = step, schedule
    events = prof.events()
    names = [e.name for e in events]
    kernel_us = sum(e.device_time_total for e in events if getattr(e, "device_type", None) is not None
                    and str(e.device_type).endswith("CUDA")) if on_cuda else 0.0
    count = lambda *keys: sum(1 for n in names if any(k in n for k in keys))  # noqa: E731
    per_step = _per_step_counts(events, num_steps)
    decode = [c for c, d in zip(per_step or [], decode_only) if d]

    def median(key: str) -> float | None:
        return statistics.median(c[key] for c in decode) if decode else None
    sync_kinds = {k: sum(c["sync_kinds"].get(k, 0) for c in decode) / len(decode)
                  for k in SYNC_CALLS} if decode else {}
    return {"batch": len(prompts), "steps": num_steps, "temperature": temperature, "top_p": top_p,
            "wall_ms_per_step": 1e3 * wall / num_steps, "kernel_ms_per_step": kernel_us / 1e3 / num_steps,
            "kernel_launches_per_step": count(*LAUNCH_CALLS) / num_steps,
            "graph_launches_per_step": count("cudaGraphLaunch") / num_steps,
            "syncs_per_step": sum(1 for n in names if n in SYNC_CALLS) / num_steps,
            "decode_steps": len(decode),
            "syncs_per_decode_step": median("syncs"),
            "kernel_launches_per_decode_step": median("launches"),
            "graph_launches_per_decode_step": median("graph_launches"),
            "sync_kinds_per_decode_step": {k: v for k, v in sync_kinds.items() if v},
            "syncs_by_step": [c["syncs"] for c in per_step] if per_step is not None else
            "not attributed: the profiler recorded no step labels on the engine's thread",
            "decode_by_step": decode_only[:num_steps],
            "sync_sources": sources,
            "device": torch.cuda.get_device_name() if on_cuda else "cpu"}


def _all_threads() -> dict:
    """The profiler's option to record every thread's ops: with async scheduling the engine core
    steps on a thread of its own (started by generate, after the profiler), where the step labels
    and the sampled tokens' reads happen. CUDA API calls (CUPTI) are recorded on every thread anyway."""
    try:
        from torch._C._profiler import _ExperimentalConfig

        return {"experimental_config": _ExperimentalConfig(profile_all_threads=True)}
    except (ImportError, TypeError):  # an older torch: the caller's thread only
        return {}


def _per_step_counts(events, num_steps: int) -> list[dict] | None:
    """Syncs and launches in each engine step's window: from its label's start to the next one's
    (the engine's worker thread may run past the call that launched its work), the last one up to
    the final synchronize, which is the profiler's and not the engine's."""
    labels = sorted(e.time_range.start for e in events if e.name == STEP_LABEL)
    end = min((e.time_range.start for e in events if e.name == "step_profile.final_sync"), default=float("inf"))
    bounds = labels + [end]
    counts = [{"syncs": 0, "launches": 0, "graph_launches": 0, "sync_kinds": {}} for _ in labels]
    for e in events:
        kind = ("syncs" if e.name in SYNC_CALLS else "launches" if e.name in LAUNCH_CALLS
                else "graph_launches" if e.name == "cudaGraphLaunch" else None)
        if kind is None:
            continue
        i = bisect.bisect_right(bounds, e.time_range.start) - 1
        if 0 <= i < len(labels):
            counts[i][kind] += 1
            if kind == "syncs":
                counts[i]["sync_kinds"][e.name] = counts[i]["sync_kinds"].get(e.name, 0) + 1
    if len(counts) != num_steps:  # labels lost (an older torch records one thread): no per-step counts
        return None
    return counts


def _sync_sources(llm, prompts, params, decode_only: list[bool], on_cuda: bool) -> dict:
    """One more run with CUDA's sync debug mode on: each synchronizing call warns, and its stack's
    innermost frame in this repository names the line. Counts per engine step of that run."""
    import traceback
    import warnings

    import torch

    getattr(llm, "reset_prefix_cache", lambda: None)()
    sources: dict[str, int] = {}

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return
        ours = [f for f in traceback.extract_stack()[:-1]
                if f.filename.startswith(str(REPO)) and not f.filename.endswith("step_profile.py")]
        where = (f"{Path(ours[-1].filename).relative_to(REPO)}:{ours[-1].lineno} {ours[-1].name}" if ours
                 else f"{filename}:{lineno}")
        sources[where] = sources.get(where, 0) + 1

    first = len(decode_only)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        if on_cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            llm.generate(prompts, params)
            if on_cuda:
                torch.cuda.synchronize()
        finally:
            if on_cuda:
                torch.cuda.set_sync_debug_mode("default")
    n = max(len(decode_only) - first, 1)
    return {"steps": len(decode_only) - first, "mode": "warn" if on_cuda else "off (no CUDA)",
            "per_step": {k: round(v / n, 3) for k, v in sorted(sources.items(), key=lambda kv: -kv[1])}}


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", default="part15_full")
    ap.add_argument("--model")
    ap.add_argument("--device")
    ap.add_argument("--dtype")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--engine-arg", action="append", default=[])
    ap.add_argument("--temperature", default="0", help="sampling temperature; a comma list profiles each in turn")
    ap.add_argument("--top-p", default="1.0", help="top_p, one per --temperature (or one for all)")
    ap.add_argument("--sync-sources", action="store_true",
                    help="one more run per setting under torch.cuda.set_sync_debug_mode('warn'): which lines sync")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    from shared.bench.__main__ import parse_engine_args

    temps, top_ps = _floats(a.temperature), _floats(a.top_p)
    if len(top_ps) == 1:
        top_ps = top_ps * len(temps)
    if len(top_ps) != len(temps):
        raise SystemExit(f"--top-p: give one value or one per --temperature ({len(temps)}), got {len(top_ps)}")
    results = profile_decodes(a.part, a.model, a.batch, a.steps, a.prompt_len, a.device, a.dtype, a.load_format,
                              parse_engine_args(a.engine_arg), list(zip(temps, top_ps)), a.sync_sources)
    for result in results:
        print(json.dumps(result))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results[0] if len(results) == 1 else results, f, indent=1)


if __name__ == "__main__":
    main()
