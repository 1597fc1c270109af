"""An OpenAI-compatible load client, measuring what `vllm bench serve` measures.

Requests are streamed (`stream: true`) with httpx directly, so the client's own overhead is a
few lines of parsing: each SSE line `data: {...}` is one chunk, `data: [DONE]` ends the stream.
Arrivals are a Poisson process at --request-rate (exponential gaps, seeded), or all at once
(rate inf) throttled by --max-concurrency. Timestamps are taken as chunks arrive; the maths
that turns them into TTFT/TPOT/ITL/E2EL lives in metrics.py.

What counts as a token: a chunk whose choice carries text (or token ids). A chunk with only a
finish_reason, the chat role preamble, or the usage block does not. Output tokens come from
the server's final `usage` (we ask for it with stream_options.include_usage); a server that
sends none is credited one token per token-carrying chunk."""
from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Coroutine, TypeVar

import numpy as np
from tqdm.auto import tqdm

from .metrics import DEFAULT_PERCENTILES, LatencyStats, RequestRecord, ServeMetrics, compute_serve_metrics
from .workload import Workload, make_workload

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
    prompt_format: str = "tokens"  # "tokens": prompt as a list of ids; "text": decoded ids
    seed: int = 0  # of the arrival times (the workload has its own)
    timeout_s: float = 600.0
    warmup: bool = True  # one short request first, to fail fast on a wrong URL/model
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES


@dataclass
class ServeResult:
    config: dict[str, Any]
    workload: dict[str, Any]
    metrics: ServeMetrics
    records: list[RequestRecord] = field(default_factory=list)

    def table(self) -> str:
        return format_serve_metrics(self.metrics, self.config)

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config, "workload": self.workload, "metrics": asdict(self.metrics),
                "records": [asdict(r) for r in self.records]}

    def save_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2))


def arrival_offsets(n: int, rate: float, seed: int = 0) -> list[float]:
    """Send times (s after the start): 0 for everyone at rate inf, else a Poisson process
    (exponential gaps of mean 1/rate; the first request goes at once, as in vLLM)."""
    if math.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])]).tolist() if n else []


def build_payload(config: ServeConfig, model: str, prompt: list[int] | str,
                  max_tokens: int) -> dict[str, Any]:
    payload: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": 0.0,
                               "stream": True, "ignore_eos": True,
                               "stream_options": {"include_usage": True}}
    if is_chat(config.endpoint):
        payload["messages"] = [{"role": "user", "content": prompt}]
    else:
        payload["prompt"] = prompt
    return payload


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
        text = (choice.get("delta") or {}).get("content")
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
    text_prompts = config.prompt_format == "text" or is_chat(config.endpoint)
    if text_prompts and tokenizer is None:
        raise ValueError("text prompts need the tokenizer to decode the random token ids")
    prompts = [tokenizer.decode(r.prompt_token_ids) if text_prompts else r.prompt_token_ids
               for r in workload.requests]
    async with make_client(config) as client:
        model = config.model or await first_model(client, config.url)
        if config.warmup:
            probe = await send_request(client, url, build_payload(config, model, prompts[0], 2),
                                       RequestRecord(workload.requests[0].prompt_len, 2))
            if not probe.success:
                raise RuntimeError(f"warm-up request to {url} failed: {probe.error}")

        limit = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
        offsets = arrival_offsets(workload.num_requests, config.request_rate, config.seed)
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
    metrics = compute_serve_metrics(records, duration, config.percentiles)
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


def format_serve_metrics(m: ServeMetrics, config: dict[str, Any] | None = None) -> str:
    """The report in `vllm bench serve`'s layout."""
    def row(name: str, value: Any) -> str:
        return f"{name:<40}{value:<10.2f}" if isinstance(value, float) else f"{name:<40}{value:<10}"

    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]
    if config:
        lines += [row("Request rate (req/s):", config.get("request_rate")),
                  row("Max concurrency:", config.get("max_concurrency") or "unbounded")]
    lines += [row("Successful requests:", m.completed), row("Failed requests:", m.failed),
              row("Benchmark duration (s):", m.duration_s),
              row("Total input tokens:", m.total_input_tokens),
              row("Total generated tokens:", m.total_output_tokens),
              row("Request throughput (req/s):", m.request_throughput),
              row("Output token throughput (tok/s):", m.output_throughput),
              row("Total token throughput (tok/s):", m.total_token_throughput),
              row("Peak concurrent requests:", m.max_concurrent_requests)]

    def section(title: str, short: str, s: LatencyStats) -> None:
        lines.append("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        lines.extend([row(f"Mean {short} (ms):", s.mean), row(f"Median {short} (ms):", s.median),
                      row(f"Std {short} (ms):", s.std)])
        lines.extend(row(f"P{p:g} {short} (ms):", v) for p, v in s.percentiles.items() if p != 50)
        if 99.0 not in s.percentiles:
            lines.append(row(f"P99 {short} (ms):", s.p99))

    section("Time to First Token", "TTFT", m.ttft_ms)
    section("Time per Output Token (excl. 1st token)", "TPOT", m.tpot_ms)
    section("Inter-token Latency", "ITL", m.itl_ms)
    section("End-to-end Latency", "E2EL", m.e2el_ms)
    lines.append("=" * 50)
    return "\n".join(lines)
