"""Where a decode step's time goes: the torch profiler over steady decoding.

`python -m shared.bench.step_profile --part part15_full --model DIR --load-format dummy --batch 64
--engine-arg enforce_eager=True --json out.json` profiles `batch` requests of `prompt_len` tokens
generating `steps` tokens each, all in one batch (after a warm-up run), so all but the first
steps are decodes of the whole batch, and reports per engine step: the wall time,
the time the device spent in kernels, the kernel launches (and CUDA-graph launches) the host made,
and the host-device synchronizations. On a GPU a step whose wall time is many times its kernel
time is bound by the host; CUDA graphs turn a step's hundreds of launches into a few.
On a CPU it runs too (no device events), which is how the GPU script is dry-run."""
from __future__ import annotations

import argparse
import importlib
import json
import time


def profile_decode(part: str, model: str | None, batch: int, steps: int, prompt_len: int, device: str | None,
                   dtype: str | None, load_format: str, engine_args: dict) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from shared.sampling_params import SamplingParams

    llm = importlib.import_module(part).LLM(model=model, device=device, dtype=dtype, load_format=load_format,
                                            max_num_seqs=max(batch, 1), **engine_args)
    try:
        on_cuda = torch.cuda.is_available() and (device or "cuda").startswith("cuda")
        prompts = [{"prompt_token_ids": [(7 * i + j) % 100 + 3 for j in range(prompt_len)]} for i in range(batch)]
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
        getattr(llm, "reset_prefix_cache", lambda: None)()
        engine, counted = llm.engine, {"steps": 0}
        step = engine.step

        def counting_step():
            counted["steps"] += 1
            return step()
        engine.step = counting_step
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
        if on_cuda:
            torch.cuda.synchronize()
        # One prompt step (or a few chunks), then `steps` decode steps of the whole batch.
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True))
            if on_cuda:
                torch.cuda.synchronize()
            wall = time.perf_counter() - start
        steps = counted["steps"]
    finally:
        getattr(llm, "shutdown", lambda: None)()
    events = prof.events()
    names = [e.name for e in events]
    kernel_us = sum(e.device_time_total for e in events if getattr(e, "device_type", None) is not None
                    and str(e.device_type).endswith("CUDA")) if on_cuda else 0.0
    count = lambda *keys: sum(1 for n in names if any(k in n for k in keys))  # noqa: E731
    return {"part": part, "batch": batch, "steps": steps, "engine_args": engine_args,
            "wall_ms_per_step": 1e3 * wall / steps, "kernel_ms_per_step": kernel_us / 1e3 / steps,
            "kernel_launches_per_step": count("cudaLaunchKernel", "cuLaunchKernel") / steps,
            "graph_launches_per_step": count("cudaGraphLaunch") / steps,
            "syncs_per_step": count("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize") / steps,
            "device": torch.cuda.get_device_name() if on_cuda else "cpu"}


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
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    from shared.bench.__main__ import parse_engine_args

    result = profile_decode(a.part, a.model, a.batch, a.steps, a.prompt_len, a.device, a.dtype, a.load_format,
                            parse_engine_args(a.engine_arg))
    print(json.dumps(result))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
