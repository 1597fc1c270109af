"""Part 15's /metrics exposition (metrics.py, stats.py), model-free: known stats in, scraped text
parsed back. The real server's numbers are checked in test_part15_metrics.py.

Expected values are worked out by hand from the inputs. Time values are binary fractions
(0.25, 0.5, ...) wherever a sum is compared exactly, so float rounding cannot decide a test."""
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from part15_full.metrics import PrometheusStatLogger, build_1_2_5_buckets, mount_metrics
from part15_full.stats import FinishedRequestStats, IterationStats, RequestTimer, SchedulerStats

MODEL = "tiny-model"


def scrape(logger: PrometheusStatLogger) -> tuple[str, dict]:
    """The exposition text and {family name: family}."""
    text = generate_latest(logger.registry).decode()
    return text, {f.name: f for f in text_string_to_metric_families(text)}


def value(families, sample_name, engine, **labels):
    family_name = sample_name.removesuffix("_total").removesuffix("_count").removesuffix("_sum")
    if family_name.endswith("_bucket"):
        family_name = family_name.removesuffix("_bucket")
    want = {"model_name": MODEL, "engine": str(engine), **labels}
    hits = [s.value for s in families[family_name].samples
            if s.name == sample_name and s.labels == want]
    assert len(hits) == 1, (sample_name, want, hits)
    return hits[0]


def test_build_1_2_5_buckets():
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert build_1_2_5_buckets(4096) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]
    assert build_1_2_5_buckets(0) == []


def test_names_types_labels_and_total_suffix():
    logger = PrometheusStatLogger(MODEL, [0, 1], spec_decode=True, offload=True,
                                  num_speculative_tokens=3)
    text, fams = scrape(logger)
    gauges = ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
              "kv_offload_cpu_cache_usage_perc"]
    counters = ["prompt_tokens", "generation_tokens", "prefix_cache_queries", "prefix_cache_hits",
                "num_preemptions", "request_success", "spec_decode_num_drafts",
                "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
                "spec_decode_num_accepted_tokens_per_pos", "kv_offload_load_bytes",
                "kv_offload_load_time", "kv_offload_store_bytes", "kv_offload_store_time"]
    histograms = ["time_to_first_token_seconds", "inter_token_latency_seconds",
                  "e2e_request_latency_seconds", "request_queue_time_seconds",
                  "request_prefill_time_seconds", "request_decode_time_seconds",
                  "request_prompt_tokens", "request_generation_tokens", "iteration_tokens_total"]
    for names, kind in ((gauges, "gauge"), (counters, "counter"), (histograms, "histogram")):
        for name in names:
            assert fams["vllm:" + name].type == kind, name
    for name in counters:  # the exposed sample carries the suffix
        assert f"\nvllm:{name}_total{{" in text
        assert f"\nvllm:{name}{{" not in text
    extra = {"vllm:request_success": {"finished_reason"},
             "vllm:spec_decode_num_accepted_tokens_per_pos": {"position"}}
    for fam in fams.values():
        for s in fam.samples:
            # each counter also exposes a `_created` timestamp, parsed as a family of its own
            base = {"model_name", "engine"} | extra.get(fam.name.removesuffix("_created"), set())
            if s.name.endswith("_bucket"):
                base.add("le")
            assert set(s.labels) == base, (s.name, s.labels)
            assert s.labels["model_name"] == MODEL and s.labels["engine"] in ("0", "1")
    reasons = {s.labels["finished_reason"] for s in fams["vllm:request_success"].samples}
    assert reasons == {"stop", "length", "abort", "error"}
    positions = {s.labels["position"]
                 for s in fams["vllm:spec_decode_num_accepted_tokens_per_pos"].samples}
    assert positions == {"0", "1", "2"}


def test_optional_families_are_absent_when_off():
    _, fams = scrape(PrometheusStatLogger(MODEL, [0]))
    assert not [n for n in fams if "spec_decode" in n or "kv_offload" in n]
    assert "vllm:num_preemptions" in fams


def test_vllm_buckets():
    logger = PrometheusStatLogger(MODEL, [0], max_model_len=1000)
    _, fams = scrape(logger)

    def bounds(name):
        return [float(s.labels["le"]) for s in fams[name].samples
                if s.name == name + "_bucket"]
    # vLLM v0.33.0 loggers.py, typed from its source
    assert bounds("vllm:time_to_first_token_seconds") == [
        0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
        10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0, float("inf")]
    assert bounds("vllm:inter_token_latency_seconds") == [
        0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
        20.0, 40.0, 80.0, float("inf")]
    latency = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0, float("inf")]
    for name in ("e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds"):
        assert bounds("vllm:" + name) == latency
    assert bounds("vllm:iteration_tokens_total") == [
        1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, float("inf")]
    assert bounds("vllm:request_prompt_tokens") == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000,
                                                    float("inf")]


def test_cumulative_scheduler_counters_two_engines_no_double_count():
    logger = PrometheusStatLogger(MODEL, [0, 1])
    reports = [
        SchedulerStats(0, num_running=3, num_waiting=1, kv_cache_usage=0.25,
                       prefix_cache_queries=10, prefix_cache_hits=4),
        SchedulerStats(1, num_running=1, num_waiting=0, kv_cache_usage=0.5,
                       prefix_cache_queries=7, prefix_cache_hits=7, num_preemptions=1),
        SchedulerStats(0, num_running=3, num_waiting=1, kv_cache_usage=0.25,
                       prefix_cache_queries=10, prefix_cache_hits=4),  # repeated as is
    ]
    for r in reports:
        logger.record(scheduler_stats=r)
    _, fams = scrape(logger)
    assert value(fams, "vllm:prefix_cache_queries_total", 0) == 10  # not 20
    assert value(fams, "vllm:prefix_cache_hits_total", 0) == 4
    assert value(fams, "vllm:num_preemptions_total", 1) == 1
    # engine 1 skips a report; both advance
    logger.record(SchedulerStats(0, num_running=5, num_waiting=2, kv_cache_usage=0.75,
                                 prefix_cache_queries=25, prefix_cache_hits=9, num_preemptions=2))
    logger.record(SchedulerStats(1, num_running=0, num_waiting=4, kv_cache_usage=1.0,
                                 prefix_cache_queries=30, prefix_cache_hits=20, num_preemptions=1))
    _, fams = scrape(logger)
    expected = {0: (25, 9, 2, 5, 2, 0.75), 1: (30, 20, 1, 0, 4, 1.0)}
    for engine, (q, h, p, run, wait, kv) in expected.items():
        assert value(fams, "vllm:prefix_cache_queries_total", engine) == q
        assert value(fams, "vllm:prefix_cache_hits_total", engine) == h
        assert value(fams, "vllm:num_preemptions_total", engine) == p
        assert value(fams, "vllm:num_requests_running", engine) == run
        assert value(fams, "vllm:num_requests_waiting", engine) == wait
        assert value(fams, "vllm:kv_cache_usage_perc", engine) == kv


def test_a_counter_that_goes_down_restarts_from_zero():
    logger = PrometheusStatLogger(MODEL, [0])
    for total in (10, 12, 3, 5):  # the engine restarted after 12
        logger.record(SchedulerStats(0, prefix_cache_queries=total))
    _, fams = scrape(logger)
    assert value(fams, "vllm:prefix_cache_queries_total", 0) == 12 + 5


def test_spec_decode_and_offload_counters():
    logger = PrometheusStatLogger(MODEL, [0, 1], spec_decode=True, offload=True,
                                  num_speculative_tokens=2)
    logger.record(SchedulerStats(1, spec_num_drafts=6, spec_num_draft_tokens=12,
                                 spec_num_accepted=8, spec_accepted_per_pos=[5, 3],
                                 offload_load_bytes=4096, offload_load_time_s=0.25,
                                 offload_store_bytes=8192, offload_store_time_s=0.5,
                                 offload_cpu_usage=0.125))
    logger.record(SchedulerStats(1, spec_num_drafts=10, spec_num_draft_tokens=23,
                                 spec_num_accepted=13, spec_accepted_per_pos=[8, 4, 1],
                                 offload_load_bytes=4096, offload_load_time_s=0.25,
                                 offload_store_bytes=12288, offload_store_time_s=0.75,
                                 offload_cpu_usage=0.0625))
    _, fams = scrape(logger)
    assert value(fams, "vllm:spec_decode_num_drafts_total", 1) == 10
    assert value(fams, "vllm:spec_decode_num_draft_tokens_total", 1) == 23
    assert value(fams, "vllm:spec_decode_num_accepted_tokens_total", 1) == 13
    per_pos = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    assert [value(fams, per_pos, 1, position=str(j)) for j in range(3)] == [8, 4, 1]
    assert [value(fams, per_pos, 0, position=str(j)) for j in range(2)] == [0, 0]
    assert value(fams, "vllm:kv_offload_load_bytes_total", 1) == 4096
    assert value(fams, "vllm:kv_offload_load_time_total", 1) == 0.25
    assert value(fams, "vllm:kv_offload_store_bytes_total", 1) == 12288
    assert value(fams, "vllm:kv_offload_store_time_total", 1) == 0.75
    assert value(fams, "vllm:kv_offload_cpu_cache_usage_perc", 1) == 0.0625
    assert value(fams, "vllm:kv_offload_store_bytes_total", 0) == 0


def test_iteration_stats_counters_and_histograms():
    logger = PrometheusStatLogger(MODEL, [0, 1], max_model_len=1000)
    done = [FinishedRequestStats("stop", e2e_latency=2.0, queue_time=0.25, prefill_time=0.5,
                                 decode_time=1.25, num_prompt_tokens=12, num_generation_tokens=30),
            FinishedRequestStats("length", e2e_latency=12.0, queue_time=4.0, prefill_time=1.0,
                                 decode_time=7.0, num_prompt_tokens=300, num_generation_tokens=64)]
    logger.record(iteration_stats=IterationStats(0, num_prompt_tokens=312,
                                                 num_generation_tokens=2,
                                                 ttfts=[0.003, 0.375]))
    logger.record(iteration_stats=IterationStats(0, num_generation_tokens=2,
                                                 itls=[0.0625, 0.625], finished=done))
    logger.record(iteration_stats=IterationStats(1, num_generation_tokens=1, itls=[0.125],
                                                 finished=[FinishedRequestStats("abort")]))
    _, fams = scrape(logger)
    assert value(fams, "vllm:prompt_tokens_total", 0) == 312
    assert value(fams, "vllm:generation_tokens_total", 0) == 4
    assert value(fams, "vllm:generation_tokens_total", 1) == 1
    succ = "vllm:request_success_total"
    reasons = ("stop", "length", "abort")
    assert [value(fams, succ, 0, finished_reason=r) for r in reasons] == [1, 1, 0]
    assert value(fams, succ, 1, finished_reason="abort") == 1
    ttft = "vllm:time_to_first_token_seconds"
    assert value(fams, ttft + "_count", 0) == 2
    assert value(fams, ttft + "_sum", 0) == pytest.approx(0.378, abs=1e-12)
    assert value(fams, ttft + "_bucket", 0, le="0.001") == 0
    assert value(fams, ttft + "_bucket", 0, le="0.005") == 1
    assert value(fams, ttft + "_bucket", 0, le="0.25") == 1
    assert value(fams, ttft + "_bucket", 0, le="0.5") == 2
    itl = "vllm:inter_token_latency_seconds"
    assert (value(fams, itl + "_count", 0), value(fams, itl + "_sum", 0)) == (2, 0.6875)
    assert (value(fams, itl + "_count", 1), value(fams, itl + "_sum", 1)) == (1, 0.125)
    for name, total in (("e2e_request_latency_seconds", 14.0), ("request_queue_time_seconds", 4.25),
                        ("request_prefill_time_seconds", 1.5),
                        ("request_decode_time_seconds", 8.25),
                        ("request_prompt_tokens", 312), ("request_generation_tokens", 94)):
        assert value(fams, f"vllm:{name}_count", 0) == 2, name
        assert value(fams, f"vllm:{name}_sum", 0) == total, name
    assert value(fams, "vllm:request_queue_time_seconds_bucket", 0, le="0.3") == 1
    assert value(fams, "vllm:request_prompt_tokens_bucket", 0, le="20.0") == 1
    assert value(fams, "vllm:request_prompt_tokens_bucket", 0, le="500.0") == 2
    it_tokens = "vllm:iteration_tokens_total"  # one observation per step: 314 and 2
    assert (value(fams, it_tokens + "_count", 0), value(fams, it_tokens + "_sum", 0)) == (2, 316)
    assert value(fams, it_tokens + "_bucket", 0, le="8.0") == 1
    assert value(fams, it_tokens + "_bucket", 0, le="512.0") == 2


def test_request_timer_follows_vllm_intervals():
    it = IterationStats(0)
    t = RequestTimer(arrival=100.0, num_prompt_tokens=7)
    t.on_scheduled(100.5)
    t.on_tokens(101.0, 1, it)  # prefill done: first token
    t.on_scheduled(101.1)  # rescheduled after a preemption: not a new start
    t.on_tokens(101.25, 2, it)  # a spec-decode step: 2 tokens, one ITL sample
    t.on_tokens(101.75, 1, it)
    f = t.on_finished(101.75, "stop", it)
    assert it.ttfts == [1.0] and it.itls == [0.25, 0.5]
    assert (it.num_prompt_tokens, it.num_generation_tokens) == (7, 4)
    assert (f.queue_time, f.prefill_time, f.decode_time, f.e2e_latency) == (0.5, 0.5, 0.75, 1.75)
    assert (f.num_prompt_tokens, f.num_generation_tokens, f.finish_reason) == (7, 4, "stop")
    assert it.finished == [f]


def test_request_timer_aborted_phases():
    it = IterationStats(0)
    waiting = RequestTimer(arrival=10.0, num_prompt_tokens=5).on_finished(12.5, "abort", it)
    assert (waiting.queue_time, waiting.prefill_time, waiting.decode_time) == (2.5, 0.0, 0.0)
    t = RequestTimer(arrival=10.0, num_prompt_tokens=5)
    t.on_scheduled(10.5)
    prefilling = t.on_finished(11.0, "abort", it)
    assert (prefilling.queue_time, prefilling.prefill_time, prefilling.decode_time) == (0.5, 0.5, 0)
    assert it.ttfts == [] and it.num_prompt_tokens == 0


def test_unknown_engine_or_reason_is_an_error():
    logger = PrometheusStatLogger(MODEL, [0, 1])
    with pytest.raises(ValueError, match="engine 2"):
        logger.record(SchedulerStats(2))
    with pytest.raises(ValueError, match="finish_reason 'cancelled'"):
        bad = IterationStats(0, finished=[FinishedRequestStats("cancelled")])
        logger.record(iteration_stats=bad)


def test_asgi_app_serves_metrics_in_fastapi():
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    logger = PrometheusStatLogger(MODEL, [0, 1])
    logger.record(SchedulerStats(1, num_waiting=6, prefix_cache_hits=3, prefix_cache_queries=9))
    app = FastAPI()
    mount_metrics(app, logger)
    plain = FastAPI()
    plain.mount("/metrics", logger.make_asgi_app())
    with TestClient(app) as client, TestClient(plain) as plain_client:
        resp = client.get("/metrics", follow_redirects=False)  # no 307 to /metrics/
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/plain")
        fams = {f.name: f for f in text_string_to_metric_families(resp.text)}
        assert value(fams, "vllm:num_requests_waiting", 1) == 6
        assert value(fams, "vllm:prefix_cache_hits_total", 1) == 3
        assert plain_client.get("/metrics", follow_redirects=False).status_code == 307
        plain_fams = {f.name: f for f in text_string_to_metric_families(
            plain_client.get("/metrics/").text)}  # same registry behind both mounts
        assert set(plain_fams) == set(fams)
        assert value(plain_fams, "vllm:num_requests_waiting", 1) == 6


def test_aborts_alone_are_no_engine_step_and_a_finished_timer_ignores_an_abort():
    logger = PrometheusStatLogger(MODEL, [0])
    it = IterationStats(0)
    done = RequestTimer(arrival=1.0, num_prompt_tokens=4)
    done.on_scheduled(1.25)
    done.on_output(1.5, 1, "length", it)  # a token and the finish in one output
    done.on_abort(2.0, it)  # its client left after it had finished: nothing more
    left = RequestTimer(arrival=1.0, num_prompt_tokens=3)
    left.on_abort(2.0, it)
    assert [f.finish_reason for f in it.finished] == ["length", "abort"]
    logger.record(iteration_stats=it)
    only_aborts = IterationStats(0)
    RequestTimer(arrival=1.0, num_prompt_tokens=5).on_abort(3.0, only_aborts)
    logger.record(iteration_stats=only_aborts)
    _, fams = scrape(logger)
    assert value(fams, "vllm:iteration_tokens_total_count", 0) == 1  # the step with the token only
    assert value(fams, "vllm:iteration_tokens_total_sum", 0) == 4 + 1
    assert [value(fams, "vllm:request_success_total", 0, finished_reason=r) for r in ("length", "abort")] == [1, 2]
    assert value(fams, "vllm:prompt_tokens_total", 0) == 4  # an abort before its first token had no prefill
    assert value(fams, "vllm:e2e_request_latency_seconds_sum", 0) == 0.5 + 1.0 + 2.0


def test_attach_stat_logger_registers_what_the_engines_have():
    from types import SimpleNamespace

    from part15_full.config import EngineConfig
    from part15_full.metrics import attach_stat_logger

    plain = SimpleNamespace(config=EngineConfig(), engine_indexes=[0], max_model_len=100)
    _, fams = scrape(attach_stat_logger(plain, MODEL))
    assert plain.stat_logger is not None
    assert not [n for n in fams if "spec_decode" in n or "kv_offload" in n]
    full = SimpleNamespace(config=EngineConfig(speculative_method="ngram", num_speculative_tokens=3,
                                               kv_offloading_size=0.5), engine_indexes=[0, 1], max_model_len=100)
    _, fams = scrape(attach_stat_logger(full, MODEL))
    positions = {(s.labels["engine"], s.labels["position"])
                 for s in fams["vllm:spec_decode_num_accepted_tokens_per_pos"].samples}
    assert positions == {(e, p) for e in "01" for p in "012"}
    assert "vllm:kv_offload_cpu_cache_usage_perc" in fams and "vllm:kv_offload_load_bytes" in fams
    assert [float(s.labels["le"]) for s in fams["vllm:request_prompt_tokens"].samples
            if s.name.endswith("_bucket") and s.labels["engine"] == "0"] == [1, 2, 5, 10, 20, 50, 100, float("inf")]
