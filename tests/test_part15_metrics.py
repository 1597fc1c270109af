"""Part 15's /metrics on a real server: a known workload in, exact counts out.

- In-process engine: three completions, one stream and a repeated prompt (all greedy, ignore_eos,
  so every output has exactly max_tokens tokens), an aborted stream, and requests refused with a
  400. The scrape must show the sums of the prompt lengths and of the output lengths, one TTFT and
  one e2e sample per request, one ITL sample per token after each request's first (one token per
  step), request_success by reason (the refused ones nowhere), the repeated prompt's full blocks as
  prefix-cache hits, and the gauges back at 0 once everything has finished.
- DP=2, engine-core processes: both engines appear; per engine, the API-side counts (timed from the
  outputs) agree with the engine-side ones (the scheduler's prefix-cache lookups), and the per-engine
  series sum to the workload's totals.
- The host tier (a real engine, stepped by hand): offload bytes and the in-flight gauge.
The exposition itself (names, buckets, cumulative counters) is tested model-free in
test_part15_metrics_logger.py."""
from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import running_server, save_tiny

MODEL = "tiny"
BLOCK = 16  # the engines' default block size
# max_position_embeddings is large so that the stream we abort could not finish on its own first.
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=8192, rms_norm_eps=1e-5, bos_token_id=1,
            eos_token_id=127, tie_word_embeddings=False)
ABORTED_MAX_TOKENS = 8000


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import LlamaConfig

    return save_tiny(tmp_path_factory.mktemp("metrics") / "tiny", LlamaConfig(**TINY), seed=0, scale=0.3)


def config(path, **kw):
    from part15_full.config import EngineConfig

    return EngineConfig(model=str(path), device="cpu", dtype="float32", kv_cache_memory_mb=4, num_threads=1, **kw)


def prompts(lengths: list[int], seed: int) -> list[list[int]]:
    """Token-id prompts whose first tokens differ: no two share a block, so no prefix hit but the
    ones a test repeats on purpose."""
    rng = random.Random(seed)
    firsts = rng.sample(range(2, 126), len(lengths))
    return [[f] + [rng.randrange(2, 126) for _ in range(n - 1)] for f, n in zip(firsts, lengths)]


def complete(url: str, prompt, max_tokens: int) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def stream(url: str, prompt: list[int], max_tokens: int, leave_after: int | None = None) -> int:
    """A streamed completion; with leave_after, the client disconnects after that many chunks.
    Returns the chunks seen."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    seen = 0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            seen += line.startswith("data: {")
            if leave_after is not None and seen >= leave_after:
                break  # leaving the block closes the connection
    return seen


def scrape(url: str) -> dict:
    r = httpx.get(f"{url}/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def samples(fams: dict, sample_name: str, **labels) -> dict[str, float]:
    """{engine: value} of one sample name, summed over the series whose labels include `labels`."""
    family = sample_name
    for suffix in ("_total", "_count", "_sum", "_bucket"):
        family = family.removesuffix(suffix)
    out = {}
    for s in fams[family].samples:
        if s.name == sample_name and all(s.labels.get(k) == v for k, v in labels.items()):
            assert s.labels["model_name"] == MODEL
            out[s.labels["engine"]] = out.get(s.labels["engine"], 0) + s.value
    return out


def total(fams: dict, sample_name: str, **labels) -> float:
    return sum(samples(fams, sample_name, **labels).values())


def wait_until(url: str, done, timeout: float = 30) -> dict:
    """Scrape until done(families) holds: an abort and the gauges settle after the client has left."""
    deadline = time.monotonic() + timeout
    while True:
        fams = scrape(url)
        if done(fams) or time.monotonic() > deadline:
            return fams
        time.sleep(0.05)


def idle(fams: dict) -> bool:
    return all(total(fams, f"vllm:{g}") == 0 for g in ("num_requests_running", "num_requests_waiting",
                                                        "kv_cache_usage_perc"))


def check_request_histograms(fams: dict, num_requests: int, engine: str | None = None) -> None:
    """The per-request families agree with each other and with the token counters."""
    labels = {} if engine is None else {"engine": engine}
    get = lambda name: total(fams, name, **labels)  # noqa: E731
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
              "request_prefill_time_seconds", "request_decode_time_seconds", "request_prompt_tokens",
              "request_generation_tokens"):
        assert get(f"vllm:{h}_count") == num_requests, h
    generated = get("vllm:generation_tokens_total")
    assert get("vllm:request_generation_tokens_sum") == generated
    assert get("vllm:request_prompt_tokens_sum") == get("vllm:prompt_tokens_total")
    # one token per step and request: an ITL sample for every token but each request's first
    assert get("vllm:inter_token_latency_seconds_count") == generated - num_requests
    assert get("vllm:iteration_tokens_total_sum") == get("vllm:prompt_tokens_total") + generated
    # One clock, so the phases tile each request's life (every request here got a token): TTFT =
    # queue + prefill, decode = its ITLs, and e2e = all three, plus the wait after the last token
    # for the aborted one. (1e-6: float sums of a few dozen values of at most seconds.)
    queue, prefill, decode, e2e = (get(f"vllm:{h}_sum") for h in (
        "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
        "e2e_request_latency_seconds"))
    assert get("vllm:time_to_first_token_seconds_sum") == pytest.approx(queue + prefill, abs=1e-6)
    assert get("vllm:inter_token_latency_seconds_sum") == pytest.approx(decode, abs=1e-6)
    assert prefill > 0 and decode > 0 and queue + prefill + decode <= e2e + 1e-6


def test_in_process_server_counts_a_known_workload(tiny):
    from part15_full.async_llm import AsyncLLM
    from part15_full.engine import LLMEngine
    from part15_full.server import build_app

    p1, p2, p3, p4, p5 = prompts([7, 21, 40, 12, 10], seed=0)
    app = build_app(AsyncLLM(LLMEngine(config(tiny))), MODEL)
    with running_server(app) as url:
        fams = scrape(url)  # before any request: every family at 0, the gauges too
        assert total(fams, "vllm:request_success_total") == 0 and idle(fams)
        replies = [complete(url, [p1, p2], 5), complete(url, p3, 9)]
        assert stream(url, p4, 6) == 6
        replies.append(complete(url, p3, 3))  # p3's two full blocks are in the cache now
        assert [r["usage"]["completion_tokens"] for r in replies] == [5 + 5, 9, 3]
        seen = stream(url, p5, ABORTED_MAX_TOKENS, leave_after=3)
        for body in ({"prompt": [500], "max_tokens": 2}, {"prompt": p1, "max_tokens": 9000}):  # refused: 400
            r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, **body}, timeout=30)
            assert r.status_code == 400, r.text
        fams = wait_until(url, lambda f: total(f, "vllm:request_success_total", finished_reason="abort") == 1
                          and idle(f))

    assert idle(fams)
    assert set(samples(fams, "vllm:prompt_tokens_total")) == {"0"}
    success = {r: total(fams, "vllm:request_success_total", finished_reason=r)
               for r in ("stop", "length", "abort", "error")}
    assert success == {"stop": 0, "length": 5, "abort": 1, "error": 0}
    assert total(fams, "vllm:prompt_tokens_total") == 7 + 21 + 40 + 12 + 40 + 10
    generated = total(fams, "vllm:generation_tokens_total")
    aborted_tokens = generated - (5 + 5 + 9 + 6 + 3)
    assert seen <= aborted_tokens < ABORTED_MAX_TOKENS  # what the client saw, and what it had not yet
    check_request_histograms(fams, num_requests=6)
    # every prompt looked up once; the repeat finds p3's full blocks but the last token's
    assert total(fams, "vllm:prefix_cache_queries_total") == 7 + 21 + 40 + 12 + 40 + 10
    assert total(fams, "vllm:prefix_cache_hits_total") == (40 - 1) // BLOCK * BLOCK
    assert total(fams, "vllm:num_preemptions_total") == 0
    assert not [n for n in fams if "spec_decode" in n or "kv_offload" in n]  # neither is on


def test_dp2_engines_each_report_their_own_requests(tiny):
    from part15_full.core_client import DPAsyncMPClient
    from part15_full.server import build_app

    ps = prompts([5, 9, 17, 30], seed=1)
    aborted = prompts([11], seed=2)[0]
    client = DPAsyncMPClient(config(tiny, data_parallel_size=2))
    try:
        with running_server(build_app(client, MODEL)) as url:
            complete(url, ps, 4)  # four requests at once: the least-loaded router alternates
            seen = stream(url, aborted, ABORTED_MAX_TOKENS, leave_after=2)
            fams = wait_until(url, lambda f: total(f, "vllm:request_success_total", finished_reason="abort") == 1
                              and idle(f))
    finally:
        client.shutdown()
    assert not any(p.is_alive() for p in client.procs.values())

    assert idle(fams)
    for family in ("vllm:prompt_tokens_total", "vllm:num_requests_running", "vllm:prefix_cache_queries_total"):
        assert set(samples(fams, family)) == {"0", "1"}, family
    length = samples(fams, "vllm:request_success_total", finished_reason="length")
    assert min(length.values()) > 0 and sum(length.values()) == 4  # both engines served
    assert total(fams, "vllm:request_success_total", finished_reason="abort") == 1
    # The API process timed each request under the engine that ran it: its prompt tokens (counted
    # from the outputs) are the ones that engine's scheduler looked up (no hits, no preemptions).
    assert samples(fams, "vllm:prompt_tokens_total") == samples(fams, "vllm:prefix_cache_queries_total")
    for engine in ("0", "1"):
        requests = length[engine] + samples(fams, "vllm:request_success_total", finished_reason="abort")[engine]
        check_request_histograms(fams, requests, engine)
    assert total(fams, "vllm:prompt_tokens_total") == 5 + 9 + 17 + 30 + 11
    assert seen <= total(fams, "vllm:generation_tokens_total") - 4 * 4 < ABORTED_MAX_TOKENS


def test_host_tier_bytes_and_its_in_flight_gauge(tiny):
    """A real engine with a host tier, stepped by hand; the stats are also taken as each step is
    launched (a spy on the executor), when its copies are still to do."""
    from part15_full.engine import LLMEngine
    from part15_full.stats import make_scheduler_stats
    from shared.sampling_params import SamplingParams

    engine = LLMEngine(config(tiny, kv_offloading_size=1 / 1024, async_scheduling=False))  # 1 MiB of host blocks
    block_bytes = 2 * 2 * BLOCK * 2 * 16 * 4  # K and V x layers x tokens x KV heads x head dim x fp32
    at_launch = []
    launch = engine.executor.execute_batch

    def spy(*args, **kwargs):
        at_launch.append(make_scheduler_stats(engine))
        return launch(*args, **kwargs)

    engine.executor.execute_batch = spy
    prompt = prompts([40], seed=3)[0]  # two full blocks and 8 tokens
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)

    def run() -> None:
        engine.add_request(engine.processor.process_inputs(prompt, params))
        while engine.has_unfinished_requests():
            engine.step()

    run()  # the prefill stores the two full prompt blocks
    host = engine.connector.manager
    held = 2 / host.num_blocks
    assert at_launch[0].offload_cpu_usage == held and at_launch[0].num_running == 1
    idle = make_scheduler_stats(engine)
    assert (idle.offload_store_bytes, idle.offload_load_bytes) == (2 * block_bytes, 0) and idle.offload_store_time_s > 0
    assert idle.offload_cpu_usage == 0 and host.usage == held  # nothing in flight, though the tier holds 2
    assert engine.kv_cache_manager.reset_prefix_cache()  # the device forgets; the host tier does not
    at_launch.clear()
    run()  # the same prompt: its two blocks come back from the host tier, pinned while they load
    assert at_launch[0].offload_cpu_usage == held
    assert (at_launch[0].num_running, at_launch[0].num_waiting) == (0, 1)  # waiting for its KV, as vLLM counts it
    done = make_scheduler_stats(engine)
    assert (done.offload_store_bytes, done.offload_load_bytes) == (2 * block_bytes, 2 * block_bytes)
    assert done.offload_load_time_s > 0 and done.offload_cpu_usage == 0
    assert (done.num_running, done.num_waiting, done.kv_cache_usage) == (0, 0, 0)
