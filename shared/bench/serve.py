"""An OpenAI-compatible load client, measuring what `vllm bench serve` measures, and its CLI.

Requests are streamed (`stream: true`) with httpx directly, so the client's own overhead is a
few lines of parsing: each SSE line `data: {...}` is one chunk, `data: [DONE]` ends the stream.
Arrivals are a Poisson process at --request-rate (exponential gaps, seeded), or gamma-distributed
gaps with --burstiness B (mean 1/rate, coefficient of variation 1/sqrt(B): B < 1 bursty, B > 1
regular, inf: evenly spaced), or all at once (rate inf); --max-concurrency caps the requests in
flight. Timestamps are taken as chunks arrive; the maths that turns them into TTFT/TPOT/ITL/E2EL,
goodput and peaks lives in metrics.py, the prompts come from datasets.py.

What counts as a token: a chunk whose choice carries text (or token ids). A chunk with only a
finish_reason, the chat role preamble, or the usage block does not. Output tokens come from
the server's final `usage` (we ask for it with stream_options.include_usage); a server that
sends none is credited one token per token-carrying chunk.

    python -m part15_full.bench serve --base-url http://127.0.0.1:8000 --dataset random \
        --random-input-len 256 --random-output-len 64 --num-prompts 200 --request-rate 8 \
        --goodput ttft:500 tpot:50 --save-result --result-file run.json

In vLLM: vllm/benchmarks/serve.py (v0.33.0: get_request, benchmark, add_cli_args, main) and
vllm/benchmarks/lib/endpoint_request_func.py (the openai and openai-chat streaming clients)."""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Coroutine, Sequence, TypeVar

import numpy as np
from tqdm.auto import tqdm

from .metrics import (DEFAULT_PERCENTILES, PERCENTILE_METRICS, RequestRecord, ServeMetrics,
                      compute_serve_metrics, parse_goodput, percentile_key, vllm_metric_fields)
from .workload import BenchRequest, Workload, make_workload

if TYPE_CHECKING:
    import httpx

T = TypeVar("T")


@dataclass
class ServeConfig:
    url: str = "http://127.0.0.1:8000"
    endpoint: str = "/v1/completions"  # or /v1/chat/completions (prompts then go as text)
    model: str | None = None  # None: the first model the server lists at /v1/models
    request_rate: float = math.inf  # requests/s of the Poisson arrivals; inf: all at once
    max_concurrency: int | None = None  # most requests in flight; None: unbounded
    # "tokens": prompts as lists of ids; "text": as text (a dataset's own, else the decoded ids);
    # "auto": text for prompts a dataset read as text (sharegpt), ids otherwise. Chat: always text.
    prompt_format: str = "tokens"
    seed: int = 0  # of the arrival times (the workload has its own)
    timeout_s: float = 600.0
    warmup: bool = True  # one short request first, to fail fast on a wrong URL/model
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES
    burstiness: float = 1.0  # shape of the gamma-distributed gaps; 1: Poisson
    goodput: dict[str, float] | None = None  # SLOs in ms, e.g. {"ttft": 200, "tpot": 50}
    percentile_metrics: tuple[str, ...] = PERCENTILE_METRICS  # sections of the report
    ignore_eos: bool = True  # sent only when true: servers other than vLLM may not know it
    temperature: float | None = 0.0  # None: not sent (the server's default)


@dataclass
class ServeResult:
    config: dict[str, Any]
    workload: dict[str, Any]
    metrics: ServeMetrics
    records: list[RequestRecord] = field(default_factory=list)

    def table(self) -> str:
        return format_serve_metrics(self.metrics, self.config, self.config.get("percentile_metrics"))

    def vllm_result(self, detailed: bool = False, label: str | None = None) -> dict[str, Any]:
        """The result JSON of `vllm bench serve --save-result` (--save-detailed: per request)."""
        rate = float(self.config["request_rate"])
        backend = "openai-chat" if is_chat(self.config["endpoint"]) else "openai"
        out: dict[str, Any] = {
            "date": datetime.now().strftime("%Y%m%d-%H%M%S"), "endpoint_type": backend,
            "backend": backend, "label": label, "model_id": self.config["model"],
            "tokenizer_id": self.workload.get("tokenizer"), "num_prompts": len(self.records),
            "request_rate": "inf" if math.isinf(rate) else rate,
            "burstiness": self.config.get("burstiness", 1.0),
            "max_concurrency": self.config.get("max_concurrency"),
            **vllm_metric_fields(self.metrics, self.config.get("percentile_metrics") or PERCENTILE_METRICS),
            "latencies": [r.latency for r in self.records]}  # vLLM keeps these even when not detailed
        if detailed:
            out.update({"input_lens": [r.prompt_len for r in self.records],
                        "output_lens": [r.output_tokens if r.success else 0 for r in self.records],
                        "ttfts": [r.ttft for r in self.records], "itls": [r.itl for r in self.records],
                        "start_times": [r.start for r in self.records],
                        "generated_texts": [r.generated_text for r in self.records],
                        "errors": [r.error for r in self.records]})
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config, "workload": self.workload, "metrics": asdict(self.metrics),
                "records": [asdict(r) for r in self.records]}

    def save_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2))


def arrival_offsets(n: int, rate: float, seed: int = 0, burstiness: float = 1.0) -> list[float]:
    """Send times (s after the start): 0 for everyone at rate inf; else gaps of mean 1/rate,
    exponential (a Poisson process) at burstiness 1, gamma(shape=B, scale=1/(rate*B)) otherwise,
    constant at B = inf. The first request goes at once."""
    if not burstiness > 0 or not rate > 0:
        raise ValueError(f"need request rate > 0 and burstiness > 0, got {rate} and {burstiness}")
    if math.isinf(rate) or n == 0:
        return [0.0] * n
    rng = np.random.default_rng(seed)
    if math.isinf(burstiness):
        gaps = np.full(n, 1.0 / rate)
    elif burstiness == 1.0:
        gaps = rng.exponential(1.0 / rate, size=n)
    else:
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])]).tolist()


def build_payload(config: ServeConfig, model: str, prompt: list[int] | str,
                  max_tokens: int) -> dict[str, Any]:
    payload: dict[str, Any] = {"model": model, "stream": True,
                               "stream_options": {"include_usage": True}}
    if config.temperature is not None:
        payload["temperature"] = config.temperature
    if config.ignore_eos:
        payload["ignore_eos"] = True
    if is_chat(config.endpoint):
        payload["messages"] = [{"role": "user", "content": prompt}]
        payload["max_completion_tokens"] = max_tokens  # chat's name; max_tokens is deprecated there
    else:
        payload["prompt"] = prompt
        payload["max_tokens"] = max_tokens
    return payload


def request_prompt(req: BenchRequest, config: ServeConfig, tokenizer: Any) -> list[int] | str:
    """What goes in the request body: token ids, or text (see ServeConfig.prompt_format)."""
    as_text = (is_chat(config.endpoint) or config.prompt_format == "text"
               or (config.prompt_format == "auto" and req.prompt is not None))
    if not as_text:
        return req.prompt_token_ids
    if req.prompt is not None:
        return req.prompt
    if tokenizer is None:
        raise ValueError("text prompts need the tokenizer to decode the random token ids")
    return tokenizer.decode(req.prompt_token_ids)


def is_chat(endpoint: str) -> bool:
    return endpoint.rstrip("/").endswith("chat/completions")


def chunk_tokens(data: dict[str, Any]) -> tuple[bool, str]:
    """(does this chunk carry tokens, its text)."""
    choices = data.get("choices") or []
    if not choices:
        return False, ""
    choice = choices[0]
    text = choice.get("text")
    if text is None:
        delta = choice.get("delta") or {}
        text = delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
    text = text or ""
    return bool(text) or bool(choice.get("token_ids")), text


async def send_request(client: httpx.AsyncClient, url: str, payload: dict[str, Any],
                       record: RequestRecord) -> RequestRecord:
    """Stream one request, filling in `record` (times relative to record.start)."""
    record.start = st = time.perf_counter()
    last = st
    chunks = 0
    usage_tokens: int | None = None
    text: list[str] = []
    try:
        async with client.stream("POST", url, json=payload) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                record.error = f"HTTP {resp.status_code}: {body[:300]}"
                return record
            async for line in resp.aiter_lines():
                line = line.strip()
                if not line.startswith("data:"):
                    continue  # blank separators, ": keep-alive" comments, event: lines
                body = line[len("data:"):].strip()
                if body == "[DONE]":
                    break
                now = time.perf_counter()
                data = json.loads(body)
                if "error" in data:
                    record.error = f"stream error: {data['error']}"
                    return record
                carries, piece = chunk_tokens(data)
                if carries:
                    if chunks == 0:
                        record.ttft = now - st
                    else:
                        record.itl.append(now - last)
                    last, chunks = now, chunks + 1
                    text.append(piece)
                if data.get("usage"):
                    usage = data["usage"]
                    usage_tokens = usage.get("completion_tokens")
                    record.prompt_len = usage.get("prompt_tokens") or record.prompt_len
    except Exception as e:  # noqa: BLE001 - a failed request is a data point, not a crash
        record.error = f"{type(e).__name__}: {e}"
        return record
    if chunks == 0:
        record.error = "no chunk carrying tokens was received"
        return record
    record.latency = last - st
    record.output_tokens = usage_tokens if usage_tokens is not None else chunks
    record.generated_text = "".join(text)
    record.success = True
    return record


async def first_model(client: httpx.AsyncClient, base_url: str) -> str:
    resp = await client.get(base_url.rstrip("/") + "/v1/models")
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


def make_client(config: ServeConfig) -> httpx.AsyncClient:
    import httpx  # imported here: the offline benchmarks do not need an HTTP client installed

    # No connection cap (httpx's default of 100 would silently throttle a large benchmark) and
    # no proxy from the environment: the benchmark talks to the server directly.
    return httpx.AsyncClient(timeout=httpx.Timeout(config.timeout_s), trust_env=False,
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))


async def run_serve_async(config: ServeConfig, workload: Workload, tokenizer: Any = None,
                          progress: bool = True) -> ServeResult:
    url = config.url.rstrip("/") + config.endpoint
    prompts = [request_prompt(r, config, tokenizer) for r in workload.requests]
    async with make_client(config) as client:
        model = config.model or await first_model(client, config.url)
        if config.warmup:
            probe = await send_request(client, url, build_payload(config, model, prompts[0], 2),
                                       RequestRecord(workload.requests[0].prompt_len, 2))
            if not probe.success:
                raise RuntimeError(f"warm-up request to {url} failed: {probe.error}")

        limit = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
        offsets = arrival_offsets(workload.num_requests, config.request_rate, config.seed,
                                  config.burstiness)
        bar = tqdm(total=workload.num_requests, desc="serve", unit="req", disable=not progress)

        async def one(i: int) -> RequestRecord:
            req = workload.requests[i]
            await asyncio.sleep(max(0.0, t0 + offsets[i] - time.perf_counter()))
            record = RequestRecord(req.prompt_len, req.output_len)
            payload = build_payload(config, model, prompts[i], req.output_len)
            if limit is None:
                await send_request(client, url, payload, record)
            else:
                async with limit:  # like vLLM: time spent waiting here is not in TTFT
                    await send_request(client, url, payload, record)
            bar.update(1)
            return record

        t0 = time.perf_counter()
        records = await asyncio.gather(*(one(i) for i in range(workload.num_requests)))
        duration = time.perf_counter() - t0
        bar.close()
    metrics = compute_serve_metrics(records, duration, config.percentiles, config.goodput)
    cfg = {**asdict(config), "model": model, "request_rate": str(config.request_rate)}
    return ServeResult(cfg, workload.describe(), metrics, list(records))


def _run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """asyncio.run, also from inside a running loop (a Jupyter cell): then in a helper thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = asyncio.run(coro)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = e

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def run_serve(config: ServeConfig | None = None, workload: Workload | None = None,
              tokenizer: Any = None, num_prompts: int = 50, input_len: str = "32:256",
              output_len: str = "16:128", progress: bool = True) -> ServeResult:
    """Benchmark a running server. Without a workload, draws one from `tokenizer` (an HF
    tokenizer, a model folder/hub id, or None for the embedded model)."""
    config = config or ServeConfig()
    if tokenizer is None or isinstance(tokenizer, (str, Path)):
        from .workload import load_tokenizer

        tokenizer = load_tokenizer(tokenizer)
    if workload is None:
        workload = make_workload(tokenizer, num_prompts, input_len, output_len, seed=config.seed)
    return _run_sync(run_serve_async(config, workload, tokenizer, progress))


SECTIONS = {"ttft": ("TTFT", "Time to First Token"),
            "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
            "itl": ("ITL", "Inter-token Latency"), "e2el": ("E2EL", "End-to-end Latency")}


def format_serve_metrics(m: ServeMetrics, config: dict[str, Any] | None = None,
                         percentile_metrics: Sequence[str] | None = None) -> str:
    """The report in `vllm bench serve`'s layout (labels padded to 40, values to 10)."""
    config = config or {}
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(name: str, value: Any, fmt: str = "") -> None:
        lines.append(f"{name:<40} {value:<10{fmt}}")

    row("Successful requests:", m.completed)
    row("Failed requests:", m.failed)
    if config.get("max_concurrency") is not None:
        row("Maximum request concurrency:", config["max_concurrency"])
    rate = float(config.get("request_rate", math.inf))
    if not math.isinf(rate):
        row("Request rate configured (RPS):", rate, ".2f")
    row("Benchmark duration (s):", m.duration_s, ".2f")
    row("Total input tokens:", m.total_input_tokens)
    row("Total generated tokens:", m.total_output_tokens)
    row("Request throughput (req/s):", m.request_throughput, ".2f")
    if m.request_goodput is not None:
        row("Request goodput (req/s):", m.request_goodput, ".2f")
    row("Output token throughput (tok/s):", m.output_throughput, ".2f")
    row("Peak output token throughput (tok/s):", m.max_output_tokens_per_s, ".2f")
    row("Peak concurrent requests:", float(m.max_concurrent_requests), ".2f")
    row("Total token throughput (tok/s):", m.total_token_throughput, ".2f")
    for name in percentile_metrics or PERCENTILE_METRICS:
        short, title = SECTIONS[name]
        stats = getattr(m, f"{name}_ms")
        lines.append("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        row(f"Mean {short} (ms):", stats.mean, ".2f")
        row(f"Median {short} (ms):", stats.median, ".2f")
        for p, value in stats.percentiles.items():
            row(f"P{percentile_key(p)} {short} (ms):", value, ".2f")
    lines.append("=" * 50)
    return "\n".join(lines)


# ---------------------------------------------------------------- CLI


def parse_number_list(text: str) -> tuple[float, ...]:
    """'50,99' -> (50.0, 99.0), each in [0, 100]."""
    values = tuple(float(x) for x in text.split(",") if x.strip())
    if not values or not all(0 <= v <= 100 for v in values):
        raise ValueError(f"--metric-percentiles {text!r}: want comma-separated numbers in [0, 100]")
    return values


def parse_metric_names(text: str) -> tuple[str, ...]:
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [n for n in names if n not in PERCENTILE_METRICS]
    if bad or not names:
        raise ValueError(f"--percentile-metrics {text!r}: choose from {','.join(PERCENTILE_METRICS)}")
    return names


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """`bench serve`'s flags, under vLLM's names (aliases: the course's shorter ones)."""
    from .datasets import add_dataset_args

    add_dataset_args(parser)
    parser.add_argument("--base-url", "--url", dest="base_url", default=None,
                        help="server base URL (default: http://HOST:PORT)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--endpoint", default=None,
                        help="/v1/completions (default) or /v1/chat/completions")
    parser.add_argument("--backend", choices=("openai", "openai-chat"), default=None,
                        help="openai-chat: the chat endpoint (what --endpoint does not say)")
    parser.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    parser.add_argument("--tokenizer", default=None,
                        help="folder or hub id of the tokenizer (default: --model when it is a local "
                             "folder, else the embedded model)")
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="requests/s; inf (default): all at once")
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="gamma shape of the arrival gaps: 1 Poisson, <1 bursty, >1 regular")
    parser.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    parser.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                        help="SLOs (ttft, tpot, e2el in ms) a request must all meet to count as good")
    parser.add_argument("--percentile-metrics", default=",".join(PERCENTILE_METRICS),
                        help="report sections (vLLM's default leaves e2el out)")
    parser.add_argument("--metric-percentiles", default="99", help="comma-separated, e.g. 50,90,99")
    parser.add_argument("--prompt-format", choices=("auto", "tokens", "text"), default="auto",
                        help="auto: ids for random prompts, text for sharegpt (chat: always text)")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="send ignore_eos (always on for the random dataset, as in vLLM)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sent with every request (vLLM's default sends none)")
    parser.add_argument("--save-result", action="store_true", help="write the result JSON")
    parser.add_argument("--save-detailed", action="store_true", help="with per-request lists")
    parser.add_argument("--result-filename", "--result-file", dest="result_filename", default=None)
    parser.add_argument("--result-dir", default=None)
    parser.add_argument("--label", default=None, help="prefix of the default result file name")
    parser.add_argument("--no-warmup", action="store_true", help="skip the initial test request")
    parser.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    parser.add_argument("--no-progress", "--disable-tqdm", dest="no_progress", action="store_true")


def result_filename(args: argparse.Namespace, model: str, backend: str, date: str) -> str:
    """vLLM's default name: {label}-{rate}qps[-concurrency{C}]-{model}-{date}.json."""
    name = args.result_filename
    if name is None:
        conc = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
        name = f"{args.label or backend}-{args.request_rate}qps{conc}-{model.split('/')[-1]}-{date}.json"
    if args.result_dir:
        Path(args.result_dir).mkdir(parents=True, exist_ok=True)
        name = str(Path(args.result_dir) / name)
    return name


def config_from_args(args: argparse.Namespace) -> tuple[ServeConfig, Workload, Any]:
    """The client's configuration, the workload and the tokenizer the parsed flags describe (a bad
    flag raises ValueError before any request)."""
    from .datasets import get_samples
    from .workload import model_token_pool

    goodput = parse_goodput(args.goodput) if args.goodput else None
    percentiles = parse_number_list(args.metric_percentiles)
    sections = parse_metric_names(args.percentile_metrics)
    if args.max_concurrency is not None and args.max_concurrency <= 0:
        raise ValueError("--max-concurrency must be > 0")
    endpoint = args.endpoint or ("/v1/chat/completions" if args.backend == "openai-chat"
                                 else "/v1/completions")
    tokenizer_id = args.tokenizer or (args.model if args.model and Path(args.model).is_dir() else None)
    token_pool, tokenizer = model_token_pool(tokenizer_id)
    workload = get_samples(args, token_pool, tokenizer)
    workload.extra.setdefault("tokenizer", getattr(tokenizer, "name_or_path", tokenizer_id))
    config = ServeConfig(
        url=args.base_url or f"http://{args.host}:{args.port}", endpoint=endpoint, model=args.model,
        request_rate=args.request_rate, max_concurrency=args.max_concurrency,
        prompt_format=args.prompt_format, seed=args.seed, timeout_s=args.timeout,
        warmup=not args.no_warmup, percentiles=percentiles, burstiness=args.burstiness, goodput=goodput,
        percentile_metrics=sections, ignore_eos=args.ignore_eos or args.dataset_name == "random",
        temperature=args.temperature)
    return config, workload, tokenizer


def run_cli(args: argparse.Namespace) -> dict[str, Any]:
    """Run `bench serve` from parsed flags: print the report, maybe save it; return the result."""
    config, workload, tokenizer = config_from_args(args)
    kind = "Poisson process" if args.burstiness == 1.0 else "Gamma distribution"
    print(f"Traffic request rate: {args.request_rate}\nBurstiness factor: {args.burstiness} ({kind})\n"
          f"Maximum request concurrency: {args.max_concurrency}")
    res = _run_sync(run_serve_async(config, workload, tokenizer, progress=not args.no_progress))
    failed = [r.error for r in res.records if not r.success]
    if failed:
        print("Failed requests during benchmark run detected (capping to 10):")
        for i, error in enumerate(failed[:10]):
            print(f"Error {i}: {error}")
    print(res.table())
    result = res.vllm_result(detailed=args.save_detailed, label=args.label)
    if args.save_result:
        path = result_filename(args, res.config["model"], result["backend"], result["date"])
        Path(path).write_text(json.dumps(result))
        print(f"wrote {path}")
    return result


def main(argv: list[str] | None = None, prog: str = "bench serve") -> int:
    parser = argparse.ArgumentParser(prog=prog, description="Benchmark an OpenAI-compatible server "
                                     "the way `vllm bench serve` does.")
    add_cli_args(parser)
    args = parser.parse_args(argv)
    try:
        result = run_cli(args)
    except ValueError as e:  # a bad flag or dataset: say so, no traceback
        parser.error(str(e))
    return 0 if result["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
