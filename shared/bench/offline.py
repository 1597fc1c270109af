"""`bench latency` and `bench throughput`: vLLM's two offline benchmarks, in process, on any part's
`LLM` (`--part`, default part15_full), with that part's engine flags (its EngineConfig's, as the
part's server takes them).

- latency: one batch of `--batch-size` prompts of `--input-len` random token ids, each generating
  exactly `--output-len` tokens (ignore_eos, temperature 1.0, as vLLM samples), run
  `--num-iters-warmup` times untimed and `--num-iters` times timed. The report is the whole batch's
  wall time per run: the average, the standard deviation and the 10/25/50/75/90/99th percentiles,
  in seconds. It answers "how long does one batch of this shape take, start to end"; at batch 1
  that is a single request's latency with nothing else running. As in vLLM, prefix caching is off
  unless asked for (the same prompts run every iteration and would all hit).
- throughput: `--num-prompts` requests of the random dataset (`--input-len`, `--output-len`, or
  `bench serve`'s dataset flags) handed to the engine at once, timed from the call to the last
  output. The report is requests/s, total (prompt + output) tokens/s and output tokens/s. It
  answers "how much work does the engine get through when it has all of it at once". Before the
  clock starts, one 2-token request warms the engine up (vLLM's engine runs a dummy batch while it
  starts); `--num-warmups N` runs N of the workload's prompts first as well.

Both print vLLM's lines and write vLLM's JSON fields with `--output-json` (and say which part and
shape they measured beside them).

    python -m part15_full.bench latency --input-len 32 --output-len 128 --batch-size 8
    python -m part15_full.bench throughput --input-len 128 --output-len 64 --num-prompts 64 --part 04

In vLLM: vllm/benchmarks/latency.py and vllm/benchmarks/throughput.py (v0.33.0: add_cli_args and
main of each), vllm/entrypoints/cli/benchmark/latency.py and throughput.py."""
from __future__ import annotations

import argparse
import importlib
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

LATENCY_PERCENTILES = (10, 25, 50, 75, 90, 99)
DEFAULT_PART = "part15_full"


# ---------------------------------------------------------------- the part and its engine flags


def part_name(name: str) -> str:
    """'part04_continuous_batching', 'part04', '04' or '4' -> the part's package name."""
    from shared.course import stages

    for s in stages():
        if name in (s.name, f"part{s.number:02d}", f"{s.number:02d}", str(s.number)):
            return s.name
    raise ValueError(f"--part {name!r}: no such part (give e.g. part04_continuous_batching or 04)")


def part_from_argv(argv: list[str] | None) -> str:
    """The --part of a command line, read before the rest: it decides which engine flags exist."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--part", default=DEFAULT_PART)
    known, _ = pre.parse_known_args(argv)
    try:
        return part_name(known.part)
    except ValueError:
        return DEFAULT_PART  # the full parser reports the bad --part with its usage line


def add_engine_args(parser: argparse.ArgumentParser, part: str) -> None:
    """--part, then that part's engine flags (its server's, from its EngineConfig)."""
    parser.add_argument("--part", default=DEFAULT_PART,
                        help=f"the part whose LLM runs (default {DEFAULT_PART}); its engine flags follow")
    group = parser.add_argument_group(f"engine ({part}'s EngineConfig)")
    importlib.import_module(f"{part}.config").EngineConfig.add_cli_args(group)


def build_llm(args: argparse.Namespace) -> Any:
    """The part's LLM from the parsed flags, the configuration checked first where the part can."""
    part = part_name(args.part)
    config_cls = importlib.import_module(f"{part}.config").EngineConfig
    config = config_cls.from_cli_args(args)
    if hasattr(config, "validate"):
        config.validate()
    return importlib.import_module(part).LLM(**config.to_dict())


def sampling_params_cls(llm: Any) -> Any:
    """The SamplingParams the LLM's part exports (the shared one where it has none)."""
    package = importlib.import_module(type(llm).__module__.split(".")[0])
    cls = getattr(package, "SamplingParams", None)
    if cls is None:
        from shared.sampling_params import SamplingParams as cls
    return cls


def max_model_len(llm: Any) -> int | None:
    for owner in (getattr(llm, "engine", None), getattr(llm, "config", None)):
        value = getattr(owner, "max_model_len", None)
        if isinstance(value, int):
            return value
    return None


def model_id(args: argparse.Namespace) -> str:
    from shared.weights import served_model_name

    return served_model_name(args.model)


def close(llm: Any) -> None:
    shutdown = getattr(llm, "shutdown", None)  # parts with worker processes (tensor parallelism)
    if shutdown is not None:
        shutdown()


# ---------------------------------------------------------------- latency


def add_latency_args(parser: argparse.ArgumentParser, part: str = DEFAULT_PART) -> None:
    parser.add_argument("--input-len", type=int, default=32, help="prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=128, help="tokens each request generates")
    parser.add_argument("--batch-size", type=int, default=8, help="requests in the batch")
    parser.add_argument("--n", type=int, default=1, help="sequences generated per prompt")
    parser.add_argument("--num-iters-warmup", type=int, default=10, help="untimed runs first")
    parser.add_argument("--num-iters", type=int, default=30, help="timed runs")
    parser.add_argument("--output-json", default=None, help="write the results (vLLM's fields) here")
    parser.add_argument("--seed", type=int, default=0, help="of the prompts' random token ids")
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bars")
    add_engine_args(parser, part)
    if "--enable-prefix-caching" in parser._option_string_actions:
        parser.set_defaults(enable_prefix_caching=False)  # every iteration runs the same prompts


def random_prompts(token_pool: list[int], num: int, input_len: int, seed: int) -> list[list[int]]:
    """`num` prompts of `input_len` token ids drawn from `token_pool` (the model's ordinary tokens)."""
    rng = np.random.default_rng(seed)
    pool = np.asarray(token_pool)
    return [pool[rng.integers(0, len(pool), size=input_len)].tolist() for _ in range(num)]


def check_latency_shape(batch_size: int, input_len: int, output_len: int, num_iters: int,
                        num_iters_warmup: int, n: int) -> None:
    if min(batch_size, input_len, output_len, num_iters, n) < 1 or num_iters_warmup < 0:
        raise ValueError("--batch-size, --input-len, --output-len, --num-iters and --n must be at least 1, "
                         "--num-iters-warmup at least 0")


def measure_latency(llm: Any, batch_size: int, input_len: int, output_len: int, num_iters: int,
                    num_iters_warmup: int = 0, n: int = 1, seed: int = 0, progress: bool = True,
                    token_pool: list[int] | None = None) -> list[float]:
    """Wall seconds of each timed run of one batch (generate called with the whole batch). The
    prompts' ids come from `token_pool` (default: the first 10,000 ids, as vLLM draws them)."""
    check_latency_shape(batch_size, input_len, output_len, num_iters, num_iters_warmup, n)
    limit = max_model_len(llm)
    if limit is not None and input_len + output_len > limit:
        raise ValueError(f"--input-len {input_len} + --output-len {output_len} exceeds the model's "
                         f"max_model_len {limit}: lower them or raise --max-model-len")
    prompts = random_prompts(token_pool or list(range(10_000)), batch_size, input_len, seed)
    sp = sampling_params_cls(llm)(n=n, temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=output_len)

    def run() -> float:
        t0 = time.perf_counter()
        llm.generate(prompts, sp)
        return time.perf_counter() - t0

    for _ in tqdm(range(num_iters_warmup), desc="Warmup iterations", disable=not progress):
        run()
    return [run() for _ in tqdm(range(num_iters), desc="Bench iterations", disable=not progress)]


def latency_results(latencies: list[float], model: str) -> dict[str, Any]:
    """vLLM's JSON of `bench latency --output-json`."""
    arr = np.asarray(latencies, dtype=float)
    return {"model_id": model, "avg_latency": float(arr.mean()), "std_latency": float(arr.std()),
            "latencies": arr.tolist(),
            "percentiles": {p: float(v) for p, v in zip(LATENCY_PERCENTILES, np.percentile(arr, LATENCY_PERCENTILES))}}


def format_latency(results: dict[str, Any]) -> str:
    """vLLM's printed report."""
    lines = [f"Avg latency: {results['avg_latency']} seconds", f"Std latency: {results['std_latency']} seconds"]
    lines += [f"{p}% percentile latency: {v} seconds" for p, v in results["percentiles"].items()]
    return "\n".join(lines)


def run_latency_cli(args: argparse.Namespace) -> dict[str, Any]:
    from .workload import model_token_pool

    check_latency_shape(args.batch_size, args.input_len, args.output_len, args.num_iters, args.num_iters_warmup,
                        args.n)
    token_pool, _ = model_token_pool(args.model)
    llm = build_llm(args)
    try:
        print("Warming up...")
        latencies = measure_latency(llm, args.batch_size, args.input_len, args.output_len, args.num_iters,
                                    args.num_iters_warmup, args.n, args.seed, progress=not args.disable_tqdm,
                                    token_pool=token_pool)
    finally:
        close(llm)
    results = latency_results(latencies, model_id(args))
    print(format_latency(results))
    results.update(part=part_name(args.part), batch_size=args.batch_size, input_len=args.input_len,
                   output_len=args.output_len, n=args.n, num_iters=args.num_iters)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(results, indent=4))
        print(f"wrote {args.output_json}")
    return results


# ---------------------------------------------------------------- throughput


def add_throughput_args(parser: argparse.ArgumentParser, part: str = DEFAULT_PART) -> None:
    from .datasets import add_dataset_args

    add_dataset_args(parser)  # --input-len, --output-len, --num-prompts, --seed, --dataset-name, ...
    parser.add_argument("--n", type=int, default=1, help="sequences generated per prompt")
    parser.add_argument("--num-warmups", type=int, default=0,
                        help="prompts of the workload run once before the timed run")
    parser.add_argument("--output-json", default=None, help="write the results (vLLM's fields) here")
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    add_engine_args(parser, part)


def measure_throughput(llm: Any, workload: Any, n: int = 1, num_warmups: int = 0) -> dict[str, Any]:
    """Run the whole workload in one generate call, timed; count the tokens that came back."""
    limit = max_model_len(llm)
    if limit is not None:
        longest = max(r.prompt_len + r.output_len for r in workload.requests)
        if longest > limit:
            raise ValueError(f"a request of {longest} tokens (prompt + output) exceeds the model's "
                             f"max_model_len {limit}: lower the lengths or raise --max-model-len")
    cls = sampling_params_cls(llm)

    def params(reqs):
        return [cls(n=n, temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=r.output_len) for r in reqs]

    first = workload.requests[0]
    llm.generate([first.prompt_token_ids[:4]], cls(temperature=1.0, ignore_eos=True, max_tokens=2))
    if num_warmups > 0:
        warm = workload.requests[:num_warmups]
        llm.generate([r.prompt_token_ids for r in warm], params(warm))
    reset = getattr(llm, "reset_prefix_cache", None)  # the warm-up's prompts must not be cached hits
    if reset is not None:
        reset()
    t0 = time.perf_counter()
    outputs = llm.generate([r.prompt_token_ids for r in workload.requests], params(workload.requests))
    elapsed = time.perf_counter() - t0
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"elapsed_time": elapsed, "num_requests": len(outputs),
            "total_num_tokens": prompt_tokens + output_tokens, "requests_per_second": len(outputs) / elapsed,
            "tokens_per_second": (prompt_tokens + output_tokens) / elapsed,
            "num_prompt_tokens": prompt_tokens, "num_output_tokens": output_tokens,
            "output_tokens_per_second": output_tokens / elapsed}


def format_throughput(r: dict[str, Any]) -> str:
    """vLLM's printed report."""
    return (f"Throughput: {r['requests_per_second']:.2f} requests/s, {r['tokens_per_second']:.2f} total tokens/s, "
            f"{r['output_tokens_per_second']:.2f} output tokens/s\n"
            f"Total num prompt tokens:  {r['num_prompt_tokens']}\n"
            f"Total num output tokens:  {r['num_output_tokens']}")


def run_throughput_cli(args: argparse.Namespace) -> dict[str, Any]:
    from .datasets import get_samples
    from .workload import model_token_pool

    if args.n < 1 or args.num_warmups < 0 or args.num_prompts < 1:
        raise ValueError("--num-prompts and --n must be at least 1, --num-warmups at least 0")
    token_pool, tokenizer = model_token_pool(args.model)
    workload = get_samples(args, token_pool, tokenizer)
    llm = build_llm(args)
    try:
        results = measure_throughput(llm, workload, args.n, args.num_warmups)
    finally:
        close(llm)
    print(format_throughput(results))
    results = {"model_id": model_id(args), **results, "part": part_name(args.part),
               "dataset": workload.extra.get("dataset", args.dataset_name), "n": args.n}
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(results, indent=4))
        print(f"wrote {args.output_json}")
    return results
