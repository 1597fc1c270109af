"""`python -m part15_full.bench serve ...`: benchmark any OpenAI-compatible server (ours, vLLM,
anyone's) the way `vllm bench serve` does, and print vLLM's "Serving Benchmark Result" table.

    python -m part15_full.server --port 8000 &
    python -m part15_full.bench serve --base-url http://127.0.0.1:8000 \
        --dataset random --random-input-len 512 --random-output-len 128 \
        --num-prompts 200 --request-rate 8 --max-concurrency 32 \
        --goodput ttft:500 tpot:50 --metric-percentiles 50,99 --save-result --result-file run.json

Datasets: random (token ids drawn from the tokenizer's vocabulary; lengths N or LOW:HIGH),
sharegpt / sharegpt-jsonl (--dataset-path: a local ShareGPT .json or .jsonl file), and
prefix_repetition (--num-prefixes shared prefixes of --prefix-len tokens, each with random
suffixes: the prefix cache's workload). The report: request and token throughput, goodput (the
requests that met every --goodput SLO, per second), peak output tokens/s and peak concurrency,
then TTFT, TPOT, ITL and E2EL (mean, median, the chosen percentiles). `--save-result` writes the
JSON under vLLM's field names, so results of both engines go into the same scripts.

Everything lives in shared/bench (the client and report in serve.py, the datasets in datasets.py,
the definitions in metrics.py), shared with `python -m shared.bench serve` of earlier parts.

In vLLM: vllm/entrypoints/cli/benchmark/serve.py (v0.33.0: the `vllm bench serve` subcommand)
and vllm/benchmarks/serve.py."""
from __future__ import annotations

import argparse
import sys

from shared.bench.serve import add_cli_args, run_cli


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m part15_full.bench", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="load an OpenAI-compatible server; TTFT/TPOT/ITL/E2EL, goodput")
    add_cli_args(serve)
    args = parser.parse_args(argv)
    try:
        result = run_cli(args)
    except ValueError as e:  # a bad flag or dataset file: one line, no traceback
        serve.error(str(e))
    return 0 if result["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
