"""`python -m shared.bench pipeline --json F`: the pipeline bubble, measured on this machine's cores.

One model (dummy weights: 8 layers of hidden 512, so a step is mostly arithmetic) runs two
workloads (prefill-heavy: 256-token prompts, 8 tokens out; decode-heavy: 64 in, 32 out) three ways,
each in worker processes that share the machine's cores evenly:
- PP 1: one stage, every layer in one process;
- PP 2 with one step in flight: two stages, each idle while the other works (the bubble);
- PP 2 with two steps in flight (part 15's default): each step holds half the sequences, and
  stage 0 runs one while stage 1 runs the other.
It reports each run's output tokens per second and mean step time, and every stage's busy
intervals (VLLM_COURSE_STEP_TIMELINE), from which each stage's idle share follows."""
from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time
from pathlib import Path

from .tiny_model import make_tiny_model

TIMELINE = "VLLM_COURSE_STEP_TIMELINE"  # part15_full/envs.py
CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512, "intermediate_size": 2048,
    "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 2048,
    "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2,
}


def run(pp: int, in_flight: int, num_requests: int = 16, prompt_len: int = 256, output_len: int = 8,
        max_num_seqs: int = 16) -> dict:
    """One engine's run: tokens a second, steps, and each rank's (start, end) step intervals."""
    from part15_full import LLM
    from part15_full.sampling_params import SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        folder = make_tiny_model(Path(tmp) / "model")  # for its tokenizer; the config is replaced
        (folder / "config.json").write_text(json.dumps(CONFIG))
        os.environ[TIMELINE] = str(Path(tmp) / "timeline")  # for the workers, which read it through envs.py
        try:
            llm = LLM(model=str(folder), load_format="dummy", device="cpu", dtype="float32",
                      distributed_executor_backend="mp", pipeline_parallel_size=pp, max_num_seqs=max_num_seqs,
                      kv_cache_memory_mb=256)
        finally:
            del os.environ[TIMELINE]
        engine = llm.engine
        if in_flight != engine.max_steps_in_flight:  # the baseline: one step at a time, all sequences in it
            engine.max_steps_in_flight = in_flight
            engine.scheduler.config = dataclasses.replace(engine.scheduler.config, pipeline_parallel_size=in_flight)
        prompts = [{"prompt_token_ids": [3 + (i * 7 + j) % 2000 for j in range(prompt_len)]}
                   for i in range(num_requests)]
        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))  # warm
        start = time.perf_counter()
        llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
        llm.shutdown()
        timelines = {}
        for f in sorted((Path(tmp) / "timeline").glob("rank*.json")):
            steps = [(s, e) for s, e in json.loads(f.read_text()) if s >= start]
            timelines[f.stem] = steps
    busy = {rank: sum(e - s for s, e in steps) for rank, steps in timelines.items()}
    return {"pp": pp, "in_flight": in_flight, "seconds": elapsed,
            "tokens_per_s": num_requests * output_len / elapsed,
            "idle_share": {rank: 1 - b / elapsed for rank, b in busy.items()},
            "mean_step_ms": {rank: 1000 * b / max(1, len(timelines[rank])) for rank, b in busy.items()},
            "timelines": {rank: [(s - start, e - start) for s, e in steps] for rank, steps in timelines.items()}}


WORKLOADS = {"prefill-heavy": (256, 8), "decode-heavy": (64, 32)}  # (prompt tokens, output tokens)
SETUPS = {"PP 1": (1, 1), "PP 2, 1 step in flight": (2, 1), "PP 2, 2 steps in flight": (2, 2)}


def run_all(num_requests: int = 16) -> dict[str, dict[str, dict]]:
    """{workload: {setup: run(...)}} for both workloads and the three setups."""
    return {w: {name: run(pp, k, num_requests, prompt, out) for name, (pp, k) in SETUPS.items()}
            for w, (prompt, out) in WORKLOADS.items()}


def main(argv: list[str] | None = None) -> None:
    import argparse
    import platform

    p = argparse.ArgumentParser(prog="python -m shared.bench pipeline", description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--requests", type=int, default=16)
    args = p.parse_args(argv)
    results = run_all(args.requests)
    for workload, runs in results.items():
        for name, r in runs.items():
            print(f"{workload:14s} {name:24s} {r['tokens_per_s']:7.1f} tokens/s; idle "
                  + ", ".join(f"{k} {v:.0%}" for k, v in r["idle_share"].items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": f"{platform.processor() or platform.machine()}, "
                                                          f"{os.cpu_count()} cores", "config": CONFIG,
                                               "runs": results}, indent=1))


if __name__ == "__main__":
    main()
