"""`python -m part15_full.bench {serve,latency,throughput,sweep}`: vLLM's benchmarking commands,
with vLLM's flags and reports.

    # a running server, the way `vllm bench serve` loads it (ours, vLLM, anyone's)
    python -m part15_full.bench serve --base-url http://127.0.0.1:8000 \\
        --dataset random --random-input-len 512 --random-output-len 128 \\
        --num-prompts 200 --request-rate 8 --max-concurrency 32 \\
        --goodput ttft:500 tpot:50 --metric-percentiles 50,99 --save-result --result-file run.json
    # one batch, start to end, in process (any part: --part 04)
    python -m part15_full.bench latency --input-len 32 --output-len 128 --batch-size 8
    # everything at once, in process: requests/s and tokens/s
    python -m part15_full.bench throughput --input-len 128 --output-len 64 --num-prompts 200
    # a server per point of a grid, `bench serve` against each, the best that meets the SLOs
    python -m part15_full.bench sweep --max-num-seqs 8,16,32 --max-num-batched-tokens 256,512,1024 \\
        --random-input-len 256 --random-output-len 64 --num-prompts 100 --request-rate 4 \\
        --goodput ttft:1000 tpot:100 -o sweep_results

serve: datasets random (token ids drawn from the tokenizer's vocabulary; lengths N or LOW:HIGH),
sharegpt / sharegpt-jsonl (--dataset-path: a local ShareGPT .json or .jsonl file), and
prefix_repetition (--num-prefixes shared prefixes of --prefix-len tokens, each with random
suffixes: the prefix cache's workload). The report: request and token throughput, goodput (the
requests that met every --goodput SLO, per second), peak output tokens/s and peak concurrency,
then TTFT, TPOT, ITL and E2EL (mean, median, the chosen percentiles). `--save-result` writes the
JSON under vLLM's field names, so results of both engines go into the same scripts.

latency and throughput build the part's LLM from its engine flags (`--part`, then the flags of
that part's server). latency reports a batch's average, standard deviation and percentiles in
seconds; throughput reports requests/s, total and output tokens/s; `--output-json` writes vLLM's
fields. sweep starts part 15's server (or `--serve-cmd`) once per point, takes every `bench serve`
flag for the client, prints a table of every point and vLLM's auto_tune line for the best, and with
`-o DIR` saves the JSON and a plot; every server it starts is stopped, also on Ctrl-C or a failed
start.

Everything lives in shared/bench: the client and report in serve.py (shared with `python -m
shared.bench serve` of earlier parts), the datasets in datasets.py, the definitions in metrics.py,
latency and throughput in offline.py, the sweep in sweep.py.

In vLLM: vllm/entrypoints/cli/benchmark/serve.py, latency.py, throughput.py and sweep.py (v0.33.0:
the `vllm bench` subcommands), vllm/benchmarks/serve.py, latency.py and throughput.py, and
benchmarks/auto_tune/auto_tune.sh."""
from __future__ import annotations

import argparse
import sys

from shared.bench import offline, sweep
from shared.bench.serve import add_cli_args as add_serve_args
from shared.bench.serve import run_cli as run_serve_cli

COMMANDS = {
    "serve": "load an OpenAI-compatible server; TTFT/TPOT/ITL/E2EL, goodput",
    "latency": "one batch's generation time, start to end, in process (any part)",
    "throughput": "requests/s and tokens/s with the whole workload at once, in process (any part)",
    "sweep": "a server per point of a flag grid, `bench serve` against each; the best that meets the SLOs",
}


def build_parser(part: str = offline.DEFAULT_PART) -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The parser and its subcommands; latency and throughput carry `part`'s engine flags."""
    parser = argparse.ArgumentParser(prog="python -m part15_full.bench", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    subs = {name: sub.add_parser(name, help=text, description=text) for name, text in COMMANDS.items()}
    add_serve_args(subs["serve"])
    offline.add_latency_args(subs["latency"], part)
    offline.add_throughput_args(subs["throughput"], part)
    sweep.add_cli_args(subs["sweep"])
    return parser, subs


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser, subs = build_parser(offline.part_from_argv(argv))
    args = parser.parse_args(argv)
    try:
        if args.command == "serve":
            return 0 if run_serve_cli(args)["completed"] else 1
        if args.command == "latency":
            offline.run_latency_cli(args)
            return 0
        if args.command == "throughput":
            offline.run_throughput_cli(args)
            return 0
        return 0 if sweep.run_cli(args).best is not None else 1
    except ValueError as e:  # a bad flag or dataset file: one line, no traceback
        subs[args.command].error(str(e))
    except sweep.SweepError as e:
        print(f"{parser.prog} sweep: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if args.command == "sweep":
            print("interrupted: the sweep stopped the server it had started", file=sys.stderr)
        return 130
    return 1


if __name__ == "__main__":
    sys.exit(main())
