"""The benchmark harness: metric maths on hand-built records, workload determinism, greedy
parity of our engine and both HF baselines through the throughput harness, and the streaming
load client against a stub SSE server with known sleeps."""
from __future__ import annotations

import asyncio
import json
import math
import threading
import time

import numpy as np
import pytest
import torch
from fastapi import FastAPI, Request  # module level: FastAPI resolves the handler's annotations here
from fastapi.responses import JSONResponse, StreamingResponse

from shared.bench.metrics import (RequestRecord, compute_serve_metrics, latency_stats,
                                  max_concurrency, request_tpot, throughput_rates)
from shared.bench.workload import BenchRequest, Workload, allowed_token_ids, make_workload, parse_range

# ---------------------------------------------------------------- metric maths


def test_latency_stats_match_numpy():
    x = np.random.default_rng(1).exponential(0.05, size=257).tolist()
    s = latency_stats(x, percentiles=(25, 50, 90, 99))
    ms = np.asarray(x) * 1000
    assert s.mean == pytest.approx(ms.mean())
    assert s.median == pytest.approx(np.median(ms))
    assert s.std == pytest.approx(ms.std())
    assert s.p99 == pytest.approx(np.percentile(ms, 99))
    for p in (25, 50, 90, 99):
        assert s.percentiles[p] == pytest.approx(np.percentile(ms, p))
    assert s.count == 257


def test_latency_stats_of_nothing_are_zero():
    s = latency_stats([])
    assert (s.mean, s.median, s.std, s.p99, s.count) == (0.0, 0.0, 0.0, 0.0, 0)


def _record(ttft, itl, output_tokens, prompt_len=10, start=0.0, success=True):
    return RequestRecord(prompt_len=prompt_len, start=start, success=success, ttft=ttft, itl=list(itl),
                         latency=ttft + sum(itl), output_tokens=output_tokens)


def test_tpot_is_decode_time_over_tokens_after_the_first():
    r = _record(0.2, [0.1, 0.1, 0.1, 0.1], output_tokens=5)
    assert request_tpot(r) == pytest.approx((0.6 - 0.2) / 4)
    # A chunk may carry several tokens: TPOT uses the token count, not the chunk count.
    r = _record(0.2, [0.3], output_tokens=7)
    assert request_tpot(r) == pytest.approx(0.3 / 6)
    assert request_tpot(_record(0.2, [], output_tokens=1)) is None
    assert request_tpot(_record(0.2, [0.1], output_tokens=2, success=False)) is None


def test_serve_metrics_aggregate_like_vllm():
    records = [
        _record(0.10, [0.05, 0.05, 0.05], output_tokens=4, prompt_len=10, start=0.0),
        _record(0.30, [0.02, 0.04], output_tokens=3, prompt_len=20, start=0.5),
        _record(0.20, [], output_tokens=1, prompt_len=30, start=0.6),  # no TPOT, no ITL
        RequestRecord(prompt_len=40, start=0.7, error="HTTP 500"),  # failed: counted apart
    ]
    m = compute_serve_metrics(records, duration_s=2.0)
    assert (m.completed, m.failed) == (3, 1)
    assert m.total_input_tokens == 60 and m.total_output_tokens == 8
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(4.0)
    assert m.total_token_throughput == pytest.approx(34.0)
    assert m.ttft_ms.mean == pytest.approx(200.0) and m.ttft_ms.count == 3
    assert m.itl_ms.count == 5  # pooled over requests
    assert m.itl_ms.median == pytest.approx(np.median([50, 50, 50, 20, 40]))
    tpots = [0.15 / 3, 0.06 / 2]
    assert m.tpot_ms.mean == pytest.approx(np.mean(tpots) * 1000) and m.tpot_ms.count == 2
    assert m.e2el_ms.mean == pytest.approx(np.mean([0.25, 0.36, 0.20]) * 1000)
    assert m.max_concurrent_requests == 2  # [0, .25] and [.5, .86] and [.6, .8]: .6-.8 overlaps


def test_max_concurrency_counts_overlaps():
    rs = [_record(1.0, [], 1, start=s) for s in (0.0, 0.5, 0.9, 2.0)]
    assert max_concurrency(rs) == 3


def test_throughput_rates():
    r = throughput_rates(num_requests=4, prompt_tokens=100, output_tokens=50, wall_s=2.0)
    assert (r.requests_per_s, r.output_tokens_per_s, r.total_tokens_per_s) == (2.0, 25.0, 75.0)


# ---------------------------------------------------------------- workload


def test_parse_range():
    assert parse_range("32:256") == (32, 256)
    assert parse_range("64") == (64, 64)
    assert parse_range(8) == (8, 8)
    with pytest.raises(ValueError):
        parse_range("9:3")


def test_workload_is_deterministic_in_range_and_special_free(hf_tokenizer):
    a = make_workload(hf_tokenizer, num_requests=16, input_len="8:40", output_len="3:9", seed=0)
    b = make_workload(hf_tokenizer, num_requests=16, input_len="8:40", output_len="3:9", seed=0)
    c = make_workload(hf_tokenizer, num_requests=16, input_len="8:40", output_len="3:9", seed=1)
    assert a.requests == b.requests
    assert a.requests != c.requests
    special = set(hf_tokenizer.all_special_ids) | {
        i for i, t in hf_tokenizer.added_tokens_decoder.items() if t.special}
    assert special  # the embedded model has some, so the check below means something
    for r in a.requests:
        assert 8 <= r.prompt_len <= 40 and 3 <= r.output_len <= 9
        assert not special & set(r.prompt_token_ids)
        assert all(0 <= t < len(hf_tokenizer) for t in r.prompt_token_ids)
    assert len(allowed_token_ids(hf_tokenizer)) == len(hf_tokenizer) - len(special)
    d = a.describe()
    assert d["prompt_tokens"] == sum(d["prompt_lens"]) and d["num_requests"] == 16


# ---------------------------------------------------------------- roofline maths


def test_decode_step_cost_scales_with_batch():
    from shared.bench.roofline import MachinePeaks, bound_row, decode_step_cost, linear_params
    from shared.config import ModelConfig

    cfg = ModelConfig("llama", vocab_size=1000, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      rms_norm_eps=1e-5, max_position_embeddings=256)
    params = 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128) + 1000 * 64
    assert linear_params(cfg) == params
    one, eight = decode_step_cost(cfg, 1, 100), decode_step_cost(cfg, 8, 100)
    assert one.weight_bytes == eight.weight_bytes == params * 4  # read once, whatever the batch
    assert eight.flops == pytest.approx(8 * one.flops)
    assert eight.kv_bytes == pytest.approx(8 * one.kv_bytes) and one.kv_bytes == 2 * 2 * 2 * 16 * 100 * 4
    peaks = MachinePeaks("cpu", "float32", matmul_flops=1e11, matmul_n=0, bandwidth=1e10, copy_bytes=0)
    row = bound_row(cfg, peaks, 1, 100, 4)
    assert row.bound_s == pytest.approx(max(row.compute_s, row.memory_s))
    assert row.memory_s > row.compute_s  # batch-1 decode is memory-bound


def test_workload_floor_counts_every_token_once():
    from shared.bench.roofline import MachinePeaks, linear_params, workload_floor
    from shared.config import ModelConfig

    cfg = ModelConfig("llama", vocab_size=1000, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      rms_norm_eps=1e-5, max_position_embeddings=256)
    peaks = MachinePeaks("cpu", "float32", matmul_flops=1e11, matmul_n=0, bandwidth=1e10, copy_bytes=0)
    head, layers = 1000 * 64, linear_params(cfg) - 1000 * 64
    # One request, prompt 3, output 2: tokens at positions 0..3 go through the layers (the 2nd
    # output is never fed back), the head runs twice, and position i attends over i + 1 keys.
    f = workload_floor(cfg, peaks, [3], [2])
    attention = 4 * 2 * 4 * 16 * (1 + 2 + 3 + 4)
    assert f.flops == pytest.approx(2 * (4 * layers + 2 * head) + attention)
    assert f.compute_s == pytest.approx(f.flops / 1e11)
    # The longest output sets the step count; each step reads every weight. Each decode token
    # reads the cached K/V before it: prompt 3, output 2: position 3 reads 3; prompt 5, output 7:
    # positions 5..10 read 5 + 6 + ... + 10 = 45 (the first output of each comes from the prefill).
    two = workload_floor(cfg, peaks, [3, 5], [2, 7])
    kv = (3 + 45) * 2 * 2 * 2 * 16 * 4  # tokens read x K and V x layers x KV heads x head_dim x fp32
    assert two.kv_bytes == kv
    assert two.min_steps == 7 and two.memory_s == pytest.approx((7 * linear_params(cfg) * 4 + kv) / 1e10)
    assert two.bound_s == max(two.compute_s, two.memory_s)
    assert two.flops == pytest.approx(f.flops + workload_floor(cfg, peaks, [5], [7]).flops)


# ---------------------------------------------------------------- throughput harness, end to end


def test_throughput_harness_greedy_parity_with_hf(llm01, hf_tokenizer):
    from shared.bench.throughput import run_throughput

    w = make_workload(hf_tokenizer, num_requests=2, input_len="5:9", output_len="3:6", seed=0)
    res = run_throughput(llm01, w, progress=False, keep_tokens=True)
    ours, static, cb = (res.system(n) for n in ("ours", "hf-generate", "hf-generate-batch"))
    for s in (ours, static, cb):
        assert s.error is None, s.error
        assert s.lengths_ok and s.output_tokens == w.output_tokens
        assert s.output_tokens_per_s > 0
    assert ours.load_s is None  # the engine was built outside the harness
    assert static.token_ids == ours.token_ids  # left-padded static batch, extra tokens cut off
    assert cb.token_ids == ours.token_ids
    assert static.matches_ours == cb.matches_ours == 2
    assert res.ratios["hf-generate"]["output_tokens_per_s"] == pytest.approx(
        ours.output_tokens_per_s / static.output_tokens_per_s)
    assert "hf-generate-batch" in res.table() and "floor:" in res.table()
    # No system can beat the floor: if one did, the floor's maths or peaks would be wrong.
    assert 0 < res.floor["bound_s"] <= min(s.wall_s for s in (ours, static, cb))
    json.dumps(res.to_dict())  # everything is JSON-serialisable


# ---------------------------------------------------------------- serve client vs a stub server

TTFT_S, GAP_S = 0.20, 0.06


def _stub_app():
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "stub-model", "object": "model"}]}

    async def stream(n: int, usage: bool):
        def chunk(choices, **extra):
            return "data: " + json.dumps({"object": "text_completion", "choices": choices, **extra}) + "\n\n"

        await asyncio.sleep(TTFT_S)
        for i in range(n):
            if i:
                await asyncio.sleep(GAP_S)
            yield chunk([{"index": 0, "text": f" t{i}", "finish_reason": None}])
        yield chunk([{"index": 0, "text": "", "finish_reason": "length"}])  # carries no token
        if usage:
            yield chunk([], usage={"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n})
        yield "data: [DONE]\n\n"

    @app.post("/{variant}/v1/completions")
    async def completions(variant: str, request: Request):
        body = await request.json()
        assert body["stream"] and body["ignore_eos"] and body["temperature"] == 0
        if variant == "fail":
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)
        return StreamingResponse(stream(body["max_tokens"], usage=variant == "usage"),
                                 media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def stub_url():
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(_stub_app(), host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 20
    while not server.started and time.time() < deadline:
        time.sleep(0.02)
    assert server.started, "stub server did not start"
    port = server.servers[0].sockets[0].getsockname()[1]  # port 0: the OS picked a free one
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=5)


def _stub_workload(n: int, out_len: int) -> Workload:
    reqs = [BenchRequest([5, 6, 7, 8], out_len) for _ in range(n)]
    return Workload(reqs, (4, 4), (out_len, out_len), seed=0, vocab_size=100)


def _serve(url, endpoint, n=3, out_len=5, **kw):
    from shared.bench.serve import ServeConfig, run_serve

    config = ServeConfig(url=url, endpoint=endpoint, **kw)
    return run_serve(config, workload=_stub_workload(n, out_len), tokenizer=object(), progress=False)


def test_serve_client_measures_stub_timings(stub_url):
    res = _serve(stub_url, "/usage/v1/completions", n=3, out_len=5, max_concurrency=3)
    m = res.metrics
    assert (m.completed, m.failed) == (3, 0)
    assert res.config["model"] == "stub-model"  # asked the server
    assert m.total_output_tokens == 15 and m.total_input_tokens == 21  # from usage
    assert m.itl_ms.count == 3 * 4  # 5 token chunks -> 4 gaps; the finish chunk is not a token
    assert m.ttft_ms.median == pytest.approx(TTFT_S * 1000, abs=80)
    assert m.itl_ms.median == pytest.approx(GAP_S * 1000, abs=40)
    assert m.tpot_ms.median == pytest.approx(GAP_S * 1000, abs=40)
    assert m.e2el_ms.median == pytest.approx((TTFT_S + 4 * GAP_S) * 1000, abs=150)
    assert all(r.generated_text == " t0 t1 t2 t3 t4" for r in res.records)
    assert "Time to First Token" in res.table()


def test_serve_client_counts_chunks_without_usage_and_reports_failures(stub_url):
    res = _serve(stub_url, "/plain/v1/completions", n=2, out_len=3, warmup=False)
    assert res.metrics.completed == 2 and res.metrics.total_output_tokens == 6  # chunk count
    bad = _serve(stub_url, "/fail/v1/completions", n=2, out_len=3, warmup=False)
    assert (bad.metrics.completed, bad.metrics.failed) == (0, 2)
    assert "HTTP 500" in bad.records[0].error


def test_serve_poisson_arrivals_are_seeded():
    from shared.bench.serve import arrival_offsets

    assert arrival_offsets(3, math.inf) == [0.0, 0.0, 0.0]
    a, b = arrival_offsets(2000, 4.0, seed=0), arrival_offsets(2000, 4.0, seed=0)
    assert a == b and a[0] == 0.0 and all(y >= x for x, y in zip(a, a[1:]))
    assert np.mean(np.diff(a)) == pytest.approx(0.25, rel=0.1)


def test_serve_cli_runs_against_stub(stub_url, tmp_path, capsys):
    from shared.bench.__main__ import main

    out = tmp_path / "serve.json"
    rc = main(["serve", "--url", stub_url, "--endpoint", "/usage/v1/completions", "--num-prompts", "2",
               "--input-len", "4:6", "--output-len", "2", "--request-rate", "20", "--no-progress",
               "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["metrics"]["completed"] == 2 and len(data["records"]) == 2
    assert "Serving Benchmark Result" in capsys.readouterr().out


# ---------------------------------------------------------------- the README's scoreboard

def _results(tps: dict[str, float], floor: float = 300.0) -> dict:
    systems = [{"name": "ours" if name == "part15" else name, "output_tokens_per_s": v, "error": None,
                "notes": {"engine": "part15_full"} if name == "part15" else {}} for name, v in tps.items()]
    systems.append({"name": "hf-generate", "output_tokens_per_s": 1.0, "error": "failed", "notes": {}})
    return {"systems": systems, "floor": {"output_tokens_per_s": floor},
            "workload": {"num_requests": 32, "input_len": [48, 200], "output_len": [24, 120]},
            "machine": {"device": "cpu", "dtype": "float32", "cpu_threads": 2}}


def test_scoreboard_table_orders_parts_then_vllm_and_divides_right(tmp_path):
    from shared.bench.scoreboard import plot, table

    results = _results({"vllm": 150.0, "part15": 120.0, "part04": 100.0})
    lines = table(results).splitlines()
    assert lines[2:] == ["| part04 | 100.0 | 1.00x | 0.67x | 33% |", "| part15 | 120.0 | 1.20x | 0.80x | 40% |",
                         "| vllm | 150.0 | 1.50x | 1.00x | 50% |"]
    plot(results, tmp_path / "s.png")
    assert (tmp_path / "s.png").stat().st_size > 1000


def test_the_readme_scoreboard_is_the_committed_run():
    """The README's CPU table is what `scoreboard` makes of notebooks/scoreboard_fp32_spr.json (a
    measured run), so it cannot drift from the numbers or be edited by hand."""
    from pathlib import Path

    from shared.bench.scoreboard import table

    root = Path(__file__).resolve().parent.parent
    results = json.loads((root / "notebooks" / "scoreboard_fp32_spr.json").read_text())
    assert table(results) in (root / "README.md").read_text()
    assert (root / "notebooks" / "scoreboard_fp32_spr.png").is_file()
    engines = {s["notes"].get("engine") for s in results["systems"]}
    assert {f"part{n:02d}" for n in range(4, 16)} <= {e[:6] for e in engines if e}


class _Rounds:
    """A system whose rounds report scripted times (as the vLLM peer reports its own clock, so no
    real sleeping and no timing luck); it remembers what the harness asked of it."""
    name, notes = "scripted", {}

    def __init__(self, walls, tokens=None):
        self.walls, self.tokens, self.calls = list(walls), tokens, []
        self.last_generate_s = None

    def load(self):
        self.calls.append("load")

    def prepare(self, requests):
        pass

    def generate(self, requests, progress=False):
        warmup = all(r.output_len <= 2 for r in requests)  # the harness's warm-up (these workloads ask 3+)
        self.calls.append("warmup" if warmup else "generate")
        if not warmup:
            self.last_generate_s = self.walls.pop(0)
        ids = [[7] * r.output_len for r in requests]
        if not warmup and self.tokens is not None:
            ids[0] = [self.tokens.pop(0)] * requests[0].output_len
        return ids

    def reset(self):
        self.calls.append("reset")

    def close(self):
        self.calls.append("close")


def test_rounds_reset_between_them_and_the_fastest_counts():
    from shared.bench.throughput import measure_system

    w = make_workload(None, 2, (8, 8), (3, 3), seed=0, token_pool=range(10, 90))
    system = _Rounds([0.3, 0.05, 0.2])
    res = measure_system(system, w, progress=False, rounds=3)
    assert res.error is None, res.notes.get("traceback")
    assert system.calls == ["load", "warmup", "generate", "reset", "generate", "reset", "generate", "close"]
    assert res.wall_s == 0.05 and res.notes["round_walls_s"] == [0.3, 0.05, 0.2]
    # A round that answers differently is an error, not a faster number.
    res = measure_system(_Rounds([0.01, 0.01], tokens=[1, 2]), w, progress=False, rounds=2)
    assert res.error and "round 2 produced other tokens" in res.error


def test_interleaved_rounds_alternate_systems_and_keep_only_the_costly_one_loaded():
    from shared.bench.throughput import measure_interleaved

    w = make_workload(None, 2, (8, 8), (3, 3), seed=0, token_pool=range(10, 90))
    a, b = _Rounds([0.02, 0.01]), _Rounds([0.01, 0.02])
    b.keep_loaded = True
    order = []
    for s, tag in ((a, "a"), (b, "b")):
        s.generate = (lambda f, t: lambda reqs, progress=False: (order.append(t), f(reqs, progress))[1])(s.generate, tag)
    res = measure_interleaved([a, b], w, progress=False, rounds=2)
    assert [r.error for r in res] == [None, None]
    # (warm-up, round) of a, of b; then the other way round: b (reset, not reloaded), a again
    assert order == ["a", "a", "b", "b", "b", "a", "a"]
    assert a.calls == ["load", "warmup", "generate", "close", "load", "warmup", "generate", "close"]
    assert b.calls == ["load", "warmup", "generate", "reset", "generate", "close"]
    assert [r.wall_s for r in res] == [0.01, 0.01]


@pytest.mark.parametrize("attr", ["page_size", "block_size"])
def test_hf_generate_batch_sizes_its_pool_with_either_transformers_spelling(monkeypatch, attr):
    """transformers 5.17 (the GPU image's) names the KV page `block_size`, later ones `page_size`:
    hf-generate-batch must size its pool from whichever the installed version has."""
    import transformers

    from shared.bench.hf_baselines import HFGenerateBatch

    class FakeConfig:
        def __init__(self, **kw):
            self.kw = kw
            setattr(self, attr, 32)

    monkeypatch.setattr(transformers, "ContinuousBatchingConfig", FakeConfig)
    system = HFGenerateBatch("unused", torch.device("cpu"), torch.float32)
    system.prepare([BenchRequest(prompt_token_ids=[1] * 40, output_len=30)])  # 70 tokens: 3 pages
    assert system.notes["page_size"] == 32 and system.cb_config.kw["num_blocks"] == 3 + 1
