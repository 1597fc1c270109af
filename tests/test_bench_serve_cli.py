"""`bench serve` (part 15's CLI, in shared/bench): goodput and peak maths on hand-built records,
the dataset builders (ShareGPT from a file written here with a word-per-token tokenizer,
prefix_repetition's shared prefixes), the flags, and whole runs against an in-process fake
OpenAI server whose delays and failures are set per request, so every figure is known in advance:
a normal request waits 50 ms for its first token and 10 ms between tokens; others are slow to
start (600 ms), slow to decode (150 ms a token) or answered with a 500. Timing bounds allow the
scheduler hundreds of ms; counts are exact."""
from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from argparse import ArgumentParser

import numpy as np
import pytest
from fastapi import FastAPI, Request  # module level: FastAPI resolves the handler's annotations here
from fastapi.responses import JSONResponse, StreamingResponse

from shared.bench.datasets import (get_samples, is_valid_sequence, prefix_repetition_dataset,
                                   random_dataset, range_with_ratio, sharegpt_dataset)
from shared.bench.metrics import (RequestRecord, compute_serve_metrics, meets_slos, parse_goodput,
                                  peak_output_throughput, percentile_key, vllm_metric_fields)
from shared.bench.serve import (ServeConfig, add_cli_args, arrival_offsets, main, parse_metric_names,
                                parse_number_list, result_filename, run_serve)
from shared.bench.workload import BenchRequest, Workload

# ---------------------------------------------------------------- metric maths


def _record(ttft, itl, output_tokens, start=0.0, success=True):
    return RequestRecord(prompt_len=4, start=start, success=success, ttft=ttft, itl=list(itl),
                         latency=ttft + sum(itl), output_tokens=output_tokens)


def test_goodput_counts_requests_meeting_every_slo():
    records = [
        _record(0.10, [0.02] * 4, 5),  # ttft 100, tpot 20, e2el 180: meets all three
        _record(0.40, [0.02] * 4, 5),  # ttft too slow
        _record(0.10, [0.09] * 4, 5),  # tpot too slow (and e2el 460)
        _record(0.25, [], 1),  # one token: TPOT counts as 0 for goodput, as in vLLM
        RequestRecord(prompt_len=4, error="HTTP 500"),  # failed: never good
    ]
    slos = parse_goodput(["ttft:300", "tpot:50"])
    assert slos == {"ttft": 300.0, "tpot": 50.0}
    assert [meets_slos(r, slos) for r in records] == [True, False, False, True, False]
    m = compute_serve_metrics(records, duration_s=2.0, goodput=slos)
    assert m.good_completed == 2 and m.request_goodput == pytest.approx(1.0)
    assert compute_serve_metrics(records, 2.0, goodput={"e2el": 200}).good_completed == 1
    assert compute_serve_metrics(records, 2.0).request_goodput is None  # no SLO: no goodput


@pytest.mark.parametrize("bad", ["ttft", "itl:5", "ttft:-1", "ttft:fast", "e2el:nan"])
def test_parse_goodput_rejects(bad):
    with pytest.raises(ValueError):
        parse_goodput([bad])


def test_peak_output_throughput_buckets_whole_seconds():
    # Token chunks at 0.1, 0.3, 0.5, 0.7 (second 0) and 1.2, 1.4, 1.6 (second 1) for the first
    # request; the second starts at 0.95: chunks at 1.05, 1.15 (second 1) and 2.3 (second 2).
    a = _record(0.1, [0.2, 0.2, 0.2, 0.5, 0.2, 0.2], 7, start=0.0)
    b = _record(0.1, [0.1, 1.15], 3, start=0.95)
    failed = RequestRecord(prompt_len=4, start=-5.0, error="x")  # not in the clock's origin
    assert peak_output_throughput([a, b, failed]) == 5.0
    assert peak_output_throughput([failed]) == 0.0


def test_vllm_metric_field_names():
    m = compute_serve_metrics([_record(0.1, [0.02, 0.04], 3)], 1.0, percentiles=(50, 99.9))
    fields = vllm_metric_fields(m, ("ttft", "e2el"))
    assert fields["completed"] == 1 and fields["total_output_tokens"] == 3
    assert fields["p50_ttft_ms"] == pytest.approx(100.0) and fields["p99.9_e2el_ms"] == pytest.approx(160.0)
    assert "mean_itl_ms" not in fields and "p99_ttft_ms" not in fields  # only what was asked
    assert {"mean_e2el_ms", "median_e2el_ms", "std_e2el_ms", "max_output_tokens_per_s",
            "max_concurrent_requests", "request_goodput", "total_token_throughput"} <= set(fields)
    assert (percentile_key(99), percentile_key(99.0), percentile_key(99.9)) == ("99", "99", "99.9")


def test_arrival_burstiness_shapes_the_gaps():
    for b, cv in ((1.0, 1.0), (4.0, 0.5), (0.25, 2.0)):
        gaps = np.diff(arrival_offsets(4001, 10.0, seed=3, burstiness=b))
        assert gaps.mean() == pytest.approx(0.1, rel=0.1)
        assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.2)  # gamma: CV = 1/sqrt(B)
    assert np.allclose(np.diff(arrival_offsets(5, 4.0, burstiness=math.inf)), 0.25)
    assert arrival_offsets(3, 2.0, seed=1, burstiness=3.0) == arrival_offsets(3, 2.0, seed=1, burstiness=3.0)
    with pytest.raises(ValueError):
        arrival_offsets(3, 2.0, burstiness=0.0)


# ---------------------------------------------------------------- datasets


class WordTokenizer:
    """One token per whitespace-separated word: lengths known by counting words."""

    def encode(self, text):
        return [1000 + len(w) for w in text.split()]

    def decode(self, ids):
        return " ".join("w" * (i - 1000) for i in ids)

    def __len__(self):
        return 2000


def _words(n, tag="w"):
    return " ".join(f"{tag}{i}" for i in range(n))


def _turns(*pairs):
    return {"conversations": [{"from": who, "value": text} for who, text in pairs]}


SHAREGPT = [
    _turns(("human", _words(5, "a")), ("gpt", _words(6))),  # kept: (5, 6)
    _turns(("system", _words(9)), ("human", _words(4, "b")), ("gpt", _words(10))),  # kept: (4, 10)
    _turns(("human", _words(3)), ("gpt", _words(8))),  # prompt under 4 tokens
    _turns(("human", _words(6, "d")), ("gpt", _words(2))),  # answer under 4 tokens
    _turns(("human", _words(7))),  # no answer
    _turns(("human", _words(1025)), ("gpt", _words(8))),  # prompt over 1024
    _turns(("human", _words(1000)), ("gpt", _words(1100))),  # both over 2048
    _turns(("human", _words(4, "c")), ("human", _words(9)), ("gpt", _words(5))),  # kept: (4, 5)
    {"id": "no conversations"},
]
KEPT = {(5, 6, _words(5, "a")), (4, 10, _words(4, "b")), (4, 5, _words(4, "c"))}


@pytest.fixture(params=["json", "jsonl"])
def sharegpt_file(request, tmp_path):
    path = tmp_path / f"share.{request.param}"
    if request.param == "json":
        path.write_text(json.dumps(SHAREGPT))
    else:
        path.write_text("\n".join(json.dumps(e) for e in SHAREGPT) + "\n")
    return path


def test_sharegpt_takes_first_exchange_and_filters_like_vllm(sharegpt_file):
    tok = WordTokenizer()
    w = sharegpt_dataset(sharegpt_file, tok, num_prompts=3, seed=0)
    assert {(r.prompt_len, r.output_len, r.prompt) for r in w.requests} == KEPT
    assert all(r.prompt_token_ids == tok.encode(r.prompt) for r in w.requests)
    big = sharegpt_dataset(sharegpt_file, tok, num_prompts=7, seed=0)  # oversampled from the 3
    assert len(big.requests) == 7 and {(r.prompt_len, r.output_len, r.prompt) for r in big.requests} == KEPT
    assert len(sharegpt_dataset(sharegpt_file, tok, 7, no_oversample=True).requests) == 3
    fixed = sharegpt_dataset(sharegpt_file, tok, num_prompts=10, output_len=3, no_oversample=True)
    # A fixed output length skips the answer-length check (the 2-word answer's entry comes back)
    # and replaces the 1100-word answer (1000 + 3 tokens now fit in 2048).
    assert {(r.prompt_len, r.output_len) for r in fixed.requests} == {(5, 3), (4, 3), (6, 3), (1000, 3)}
    assert sharegpt_dataset(sharegpt_file, tok, 3, seed=5).requests == sharegpt_dataset(
        sharegpt_file, tok, 3, seed=5).requests


def test_is_valid_sequence_edges():
    assert is_valid_sequence(4, 4) and not is_valid_sequence(3, 4) and not is_valid_sequence(4, 3)
    assert is_valid_sequence(1024, 1024) and not is_valid_sequence(1025, 4)
    assert not is_valid_sequence(1024, 1025) and is_valid_sequence(4, 1, skip_min_output_len_check=True)


def test_prefix_repetition_groups_share_their_prefix():
    pool = list(range(1000, 2000))
    w = prefix_repetition_dataset(pool, num_prompts=10, prefix_len=16, suffix_len=8, num_prefixes=3,
                                  output_len=5, seed=0)
    assert len(w.requests) == 9  # 10 // 3 = 3 prompts per prefix; the remainder is dropped
    groups: dict[tuple[int, ...], list[BenchRequest]] = {}
    for r in w.requests:
        assert r.prompt_len == 24 and r.output_len == 5 and set(r.prompt_token_ids) <= set(pool)
        groups.setdefault(tuple(r.prompt_token_ids[:16]), []).append(r)
    assert sorted(len(g) for g in groups.values()) == [3, 3, 3]
    for g in groups.values():  # within a group only the suffixes differ
        assert len({tuple(r.prompt_token_ids[16:]) for r in g}) == 3
    again = prefix_repetition_dataset(pool, 10, 16, 8, 3, 5, seed=0)
    assert again.requests == w.requests
    grouped = prefix_repetition_dataset(pool, 10, 16, 8, 3, 5, seed=0, shuffle=False)
    assert sorted(map(tuple, (r.prompt_token_ids for r in grouped.requests))) == sorted(
        map(tuple, (r.prompt_token_ids for r in w.requests)))  # shuffling only reorders
    heads = [tuple(r.prompt_token_ids[:16]) for r in grouped.requests]
    assert heads[0] == heads[1] == heads[2] != heads[3] == heads[4] == heads[5] != heads[6]
    with pytest.raises(ValueError):
        prefix_repetition_dataset(pool, num_prompts=2, num_prefixes=3)


def test_random_range_ratio():
    assert range_with_ratio("100", 0.5) == (50, 150) and range_with_ratio("8:16", 0.0) == (8, 16)
    with pytest.raises(ValueError):
        range_with_ratio("8:16", 0.5)
    with pytest.raises(ValueError):
        range_with_ratio("100", 1.0)
    w = random_dataset(list(range(50)), 40, "100", "10", seed=1, range_ratio=0.5)
    assert all(50 <= r.prompt_len <= 150 and 5 <= r.output_len <= 15 for r in w.requests)
    assert len({r.prompt_len for r in w.requests}) > 1


# ---------------------------------------------------------------- flags


def _parse(*argv):
    parser = ArgumentParser()
    add_cli_args(parser)
    return parser.parse_args(list(argv))


def test_flags_and_aliases(tmp_path):
    a = _parse("--url", "http://x:1", "--dataset", "prefix_repetition", "--prefix-len", "32",
               "--num-prefixes", "4", "--result-file", "r.json", "--disable-tqdm", "--goodput", "ttft:5",
               "tpot:1", "--request-rate", "inf")
    assert (a.base_url, a.dataset_name) == ("http://x:1", "prefix_repetition")
    assert (a.prefix_len, a.num_prefixes) == (32, 4)
    assert a.result_filename == "r.json" and a.no_progress and a.goodput == ["ttft:5", "tpot:1"]
    assert math.isinf(a.request_rate)
    b = _parse("--dataset-name", "sharegpt-jsonl", "--prefix-repetition-prefix-len", "7",
               "--metric-percentiles", "50,99.9", "--percentile-metrics", "ttft,e2el")
    assert b.dataset_name == "sharegpt-jsonl" and b.prefix_len == 7
    assert parse_number_list(b.metric_percentiles) == (50.0, 99.9)
    assert parse_metric_names(b.percentile_metrics) == ("ttft", "e2el")
    for bad in ("ttft,foo", ""):
        with pytest.raises(ValueError):
            parse_metric_names(bad)
    with pytest.raises(ValueError):
        parse_number_list("50,101")
    c = _parse("--max-concurrency", "4", "--request-rate", "2.5", "--label", "ours",
               "--result-dir", str(tmp_path))
    assert result_filename(c, "org/Model-1", "openai", "20250101-000000") == str(
        tmp_path / "ours-2.5qps-concurrency4-Model-1-20250101-000000.json")
    pool = list(range(100, 200))
    with pytest.raises(ValueError, match="dataset-path"):
        get_samples(_parse("--dataset-path", "x.json"), pool, None)  # random takes no file
    with pytest.raises(ValueError, match="dataset-path"):
        get_samples(_parse("--dataset", "sharegpt"), pool, WordTokenizer())
    w = get_samples(_parse("--input-len", "6:9", "--random-output-len", "3", "--num-prompts", "5"),
                    pool, None)
    assert len(w.requests) == 5 and all(6 <= r.prompt_len <= 9 and r.output_len == 3 for r in w.requests)


def test_cli_rejects_bad_goodput_before_any_request(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--base-url", "http://127.0.0.1:9", "--goodput", "itl:5", "--no-progress"])
    assert e.value.code == 2 and "goodput" in capsys.readouterr().err


# ---------------------------------------------------------------- a fake OpenAI server

FAST = (0.05, 0.01)  # (seconds to the first token, seconds between tokens)
SLOW_START, SLOW_DECODE, FAIL = 7, 8, 13  # first prompt id of a request that should be slow / fail
TIMING = {SLOW_START: (0.6, 0.01), SLOW_DECODE: (0.05, 0.15)}


def _fake_app():
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    def sse(payload):
        return "data: " + json.dumps(payload) + "\n\n"

    async def stream(n, prompt_tokens, timing, chat):
        first, gap = timing
        if chat:
            yield sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        await asyncio.sleep(first)
        for i in range(n):
            if i:
                await asyncio.sleep(gap)
            piece = {"delta": {"content": f" t{i}"}} if chat else {"text": f" t{i}"}
            yield sse({"choices": [{"index": 0, **piece, "finish_reason": None}]})
        done = {"delta": {}} if chat else {"text": ""}
        yield sse({"choices": [{"index": 0, **done, "finish_reason": "length"}]})
        yield sse({"choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                                            "total_tokens": prompt_tokens + n}})
        yield "data: [DONE]\n\n"

    @app.post("/{variant}/v1/completions")
    async def completions(variant: str, request: Request):
        body = await request.json()
        prompt = body["prompt"]
        assert isinstance(prompt, list) and body["stream"]
        timing = TIMING.get(prompt[0], FAST) if variant == "mixed" else FAST
        if variant == "mixed" and prompt[0] == FAIL:
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)
        return StreamingResponse(stream(body["max_tokens"], len(prompt), timing, chat=False),
                                 media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        text = body["messages"][0]["content"]
        assert isinstance(text, str) and "max_tokens" not in body
        return StreamingResponse(stream(body["max_completion_tokens"], len(text.split()), FAST, chat=True),
                                 media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def fake_url():
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(_fake_app(), host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 20
    while not server.started and time.time() < deadline:
        time.sleep(0.02)
    assert server.started, "fake server did not start"
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=5)
    assert not thread.is_alive()


def _workload(markers, prompt_len=6, out_len=6):
    reqs = [BenchRequest([m] + [500 + i] * (prompt_len - 1), out_len) for i, m in enumerate(markers)]
    return Workload(reqs, (prompt_len, prompt_len), (out_len, out_len), seed=0, vocab_size=1000)


def test_fake_server_timings_are_measured(fake_url):
    res = run_serve(ServeConfig(url=fake_url, endpoint="/plain/v1/completions", percentiles=(50, 99)),
                    workload=_workload([100] * 8), tokenizer=object(), progress=False)
    m = res.metrics
    assert (m.completed, m.failed) == (8, 0)
    assert (m.total_input_tokens, m.total_output_tokens) == (48, 48)
    assert m.itl_ms.count == 8 * 5 and m.tpot_ms.count == 8
    # The server sleeps 50 ms before the first token: no TTFT can be shorter.
    assert 49 <= min(r.ttft for r in res.records) * 1000 and m.ttft_ms.median <= 50 + 300
    assert 3 <= m.itl_ms.median <= 10 + 50 and 3 <= m.tpot_ms.mean <= 10 + 50
    assert 50 + 5 * 3 <= m.e2el_ms.median <= 100 + 400
    # TPOT is per request the decode time over the tokens after the first: the ITLs' mean here.
    per_request = [sum(r.itl) / 5 * 1000 for r in res.records]
    assert m.tpot_ms.mean == pytest.approx(np.mean(per_request))
    assert m.max_concurrent_requests == 8  # all sent at once, none done before the last started
    assert 0 < m.max_output_tokens_per_s <= 48
    assert all(r.generated_text == " t0 t1 t2 t3 t4 t5" for r in res.records)


def test_goodput_and_failures_against_the_fake(fake_url):
    markers = [100] * 4 + [SLOW_START] * 2 + [SLOW_DECODE] * 2 + [FAIL] * 2
    config = ServeConfig(url=fake_url, endpoint="/mixed/v1/completions", goodput={"ttft": 300, "tpot": 60})
    res = run_serve(config, workload=_workload(markers), tokenizer=object(), progress=False)
    m = res.metrics
    assert (m.completed, m.failed) == (8, 2) and m.total_output_tokens == 8 * 6
    assert all("HTTP 500" in r.error for r in res.records[-2:])
    assert m.good_completed == 4  # the four fast ones: half of the requests sent
    assert m.request_goodput * m.duration_s == pytest.approx(4)
    # The same records under other SLOs: slow decoders start in time, slow starters decode in time.
    assert compute_serve_metrics(res.records, m.duration_s, goodput={"ttft": 300}).good_completed == 6
    assert compute_serve_metrics(res.records, m.duration_s, goodput={"tpot": 60}).good_completed == 6
    assert compute_serve_metrics(res.records, m.duration_s, goodput={"e2el": 400}).good_completed == 4
    assert m.max_concurrent_requests == 8
    assert "Request goodput (req/s):" in res.table() and "Failed requests:" in res.table()


def test_cli_end_to_end_random(fake_url, tmp_path, capsys, model_path, hf_tokenizer):
    out = tmp_path / "res.json"
    rc = main(["--base-url", fake_url, "--endpoint", "/plain/v1/completions", "--dataset", "random",
               "--random-input-len", "4:8", "--random-output-len", "3", "--num-prompts", "6",
               "--request-rate", "40", "--burstiness", "2", "--max-concurrency", "4",
               "--goodput", "ttft:5000", "e2el:10000", "--metric-percentiles", "50,99", "--seed", "3",
               "--tokenizer", str(model_path), "--save-result", "--result-file", str(out), "--no-progress"])
    assert rc == 0
    printed = capsys.readouterr().out
    printed = printed[printed.index("=== Serving Benchmark Result ==="):]  # the preamble says more
    labels = ["Successful requests:", "Failed requests:", "Maximum request concurrency:",
              "Request rate configured (RPS):", "Benchmark duration (s):", "Total input tokens:",
              "Total generated tokens:", "Request throughput (req/s):", "Request goodput (req/s):",
              "Output token throughput (tok/s):", "Peak output token throughput (tok/s):",
              "Peak concurrent requests:", "Total token throughput (tok/s):", "Time to First Token",
              "Mean TTFT (ms):", "Median TTFT (ms):", "P50 TTFT (ms):", "P99 TTFT (ms):",
              "Time per Output Token (excl. 1st token)", "Inter-token Latency", "End-to-end Latency",
              "P99 E2EL (ms):"]
    positions = [printed.index(label) for label in labels]
    assert positions == sorted(positions)  # all there, in vLLM's order
    assert f"{'Successful requests:':<40} 6" in printed  # vLLM's layout: label in 40 columns, a space
    data = json.loads(out.read_text())
    w = random_dataset(list(range(10)), 6, "4:8", "3", seed=3)  # the same lengths, any ids
    assert (data["completed"], data["failed"], data["num_prompts"]) == (6, 0, 6)
    assert data["total_input_tokens"] == sum(r.prompt_len for r in w.requests)
    assert 24 <= data["total_input_tokens"] <= 48 and data["total_output_tokens"] == 18
    assert data["request_goodput"] == pytest.approx(data["request_throughput"])  # every one met both
    assert data["request_throughput"] == pytest.approx(6 / data["duration"])
    assert (data["max_concurrency"], data["request_rate"], data["burstiness"]) == (4, 40.0, 2.0)
    assert 1 <= data["max_concurrent_requests"] <= 4 and data["model_id"] == "fake-model"
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p99"):
            assert f"{stat}_{metric}_ms" in data
        assert f"p90_{metric}_ms" not in data
    assert len(data["latencies"]) == 6 and "ttfts" not in data and "itls" not in data  # not detailed


def test_cli_sharegpt_over_chat_saves_details(fake_url, tmp_path, capsys, model_path, hf_tokenizer):
    path = tmp_path / "share.jsonl"
    rows = [_turns(("human", "Tell me about the sea and the ships on it"),
                   ("gpt", "The sea is wide and deep.")),
            _turns(("human", "List three colours of the rainbow, please"),
                   ("gpt", "Red, orange and yellow."))]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "chat.json"
    rc = main(["--base-url", fake_url, "--backend", "openai-chat", "--dataset", "sharegpt-jsonl",
               "--dataset-path", str(path), "--num-prompts", "2", "--disable-shuffle", "--percentile-metrics",
               "ttft,e2el", "--tokenizer", str(model_path), "--save-result", "--save-detailed",
               "--result-filename", str(out), "--no-progress"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "End-to-end Latency" in printed and "Inter-token Latency" not in printed
    assert "Request goodput" not in printed and "Request rate configured" not in printed
    data = json.loads(out.read_text())
    expected_out = [len(hf_tokenizer.encode(r["conversations"][1]["value"])) for r in rows]
    assert data["backend"] == "openai-chat" and data["completed"] == 2 and data["request_goodput"] is None
    assert data["output_lens"] == expected_out  # the gpt turn's token count, generated in full
    assert data["input_lens"] == [10, 7]  # the fake's usage: words of the prompt text
    assert data["generated_texts"] == ["".join(f" t{i}" for i in range(n)) for n in expected_out]
    assert [len(x) for x in data["itls"]] == [n - 1 for n in expected_out] and data["errors"] == ["", ""]
    assert "mean_tpot_ms" not in data and "p99_e2el_ms" in data


def test_part15_entry_point_is_the_same_cli(fake_url, tmp_path, capsys, model_path):
    bench = pytest.importorskip("part15_full.bench")  # the entry point, once part 15 exists
    rc = bench.main(["serve", "--base-url", fake_url, "--endpoint", "/plain/v1/completions",
                     "--random-input-len", "4", "--random-output-len", "2", "--num-prompts", "2",
                     "--tokenizer", str(model_path), "--no-progress"])
    assert rc == 0 and "Serving Benchmark Result" in capsys.readouterr().out
