"""`python -m part15_full.bench latency` and `throughput` (shared/bench/offline.py): vLLM's printed
reports and JSON fields on a tiny random Llama (config.json and the embedded tokenizer, random
weights), any part through --part, and what each measures, checked on a fake LLM that records
what it was asked to generate. No assertion depends on how fast anything runs."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest

from part15_full import bench
from shared.bench import offline

TINY_FLAGS = ["--load-format", "dummy", "--device", "cpu", "--dtype", "float32", "--kv-cache-memory-mb", "16"]
FLOAT = r"[0-9.e+-]+"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from test_part15_server import tiny_model_folder

    return tiny_model_folder(tmp_path_factory.mktemp("tiny"))


# ---------------------------------------------------------------- what is measured, on a fake


@dataclass
class FakeLLM:
    """Records each generate call; returns outputs of the requested lengths."""
    engine: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(max_model_len=64))
    calls: list = field(default_factory=list)

    def generate(self, prompts, params):
        from shared.outputs import CompletionOutput, RequestOutput

        self.calls.append((prompts, params))
        ps = params if isinstance(params, list) else [params] * len(prompts)
        return [RequestOutput(str(i), None, list(p), [CompletionOutput(j, "", [7] * sp.max_tokens)
                                                       for j in range(sp.n)], finished=True)
                for i, (p, sp) in enumerate(zip(prompts, ps))]


def test_latency_times_whole_batches_after_the_warmup():
    llm = FakeLLM()
    latencies = offline.measure_latency(llm, batch_size=3, input_len=5, output_len=7, num_iters=4,
                                        num_iters_warmup=2, n=2, progress=False, token_pool=list(range(100, 110)))
    assert len(latencies) == 4 and all(t >= 0 for t in latencies)
    assert len(llm.calls) == 2 + 4  # warm-up runs, then timed runs, each the whole batch in one call
    prompts, sp = llm.calls[0]
    assert len(prompts) == 3 and all(len(p) == 5 and set(p) <= set(range(100, 110)) for p in prompts)
    assert all(call[0] == prompts for call in llm.calls)  # the same batch every run
    assert (sp.max_tokens, sp.ignore_eos, sp.temperature, sp.top_p, sp.n) == (7, True, 1.0, 1.0, 2)
    with pytest.raises(ValueError, match="max_model_len 64"):
        offline.measure_latency(llm, 1, 60, 8, 1, progress=False)
    with pytest.raises(ValueError, match="at least 1"):
        offline.measure_latency(llm, 0, 4, 4, 1, progress=False)


def test_latency_report_has_vllms_lines_and_fields():
    res = offline.latency_results([1.0, 2.0, 3.0, 4.0], "m")
    assert list(res) == ["model_id", "avg_latency", "std_latency", "latencies", "percentiles"]
    assert res["avg_latency"] == 2.5 and res["std_latency"] == pytest.approx(1.118, abs=1e-3)
    assert list(res["percentiles"]) == [10, 25, 50, 75, 90, 99] and res["percentiles"][50] == 2.5
    lines = offline.format_latency(res).splitlines()
    assert lines[:3] == ["Avg latency: 2.5 seconds", f"Std latency: {res['std_latency']} seconds",
                         f"10% percentile latency: {res['percentiles'][10]} seconds"]
    assert lines[-1] == f"99% percentile latency: {res['percentiles'][99]} seconds" and len(lines) == 8


def test_throughput_counts_what_came_back_over_one_timed_call():
    from shared.bench.workload import make_workload

    llm = FakeLLM()
    w = make_workload(num_requests=5, input_len=6, output_len="3:5", seed=1, token_pool=list(range(50)))
    r = offline.measure_throughput(llm, w, n=2, num_warmups=2)
    # one 2-token warm-up, the --num-warmups prompts, then the whole workload in one call
    assert [len(c[0]) for c in llm.calls] == [1, 2, 5]
    assert llm.calls[0][1].max_tokens == 2 and [sp.max_tokens for sp in llm.calls[2][1]] == [q.output_len for q in w.requests]
    assert r["num_requests"] == 5 and r["num_prompt_tokens"] == 30
    assert r["num_output_tokens"] == 2 * w.output_tokens and r["total_num_tokens"] == 30 + 2 * w.output_tokens
    assert r["requests_per_second"] == pytest.approx(5 / r["elapsed_time"])
    assert r["tokens_per_second"] == pytest.approx(r["total_num_tokens"] / r["elapsed_time"])
    text = offline.format_throughput(r)
    assert re.fullmatch(rf"Throughput: {FLOAT} requests/s, {FLOAT} total tokens/s, {FLOAT} output tokens/s\n"
                        rf"Total num prompt tokens:  30\nTotal num output tokens:  {2 * w.output_tokens}", text)


# ---------------------------------------------------------------- the commands, on a tiny model


def test_latency_cli_on_part15_and_on_part04(tiny, tmp_path, capsys):
    out = tmp_path / "lat.json"
    assert bench.main(["latency", "--model", str(tiny), *TINY_FLAGS, "--input-len", "8", "--output-len", "4",
                       "--batch-size", "2", "--num-iters-warmup", "1", "--num-iters", "3", "--output-json", str(out),
                       "--disable-tqdm"]) == 0
    printed = capsys.readouterr().out
    expected = [r"Avg latency", r"Std latency"] + [rf"{p}% percentile latency" for p in (10, 25, 50, 75, 90, 99)]
    found = re.findall(rf"^(.+): ({FLOAT}) seconds$", printed, flags=re.M)
    assert [name for name, _ in found] == expected
    data = json.loads(out.read_text())
    assert {"model_id", "avg_latency", "std_latency", "latencies", "percentiles"} <= set(data)
    assert data["model_id"] == tiny.name and len(data["latencies"]) == 3 and data["part"] == "part15_full"
    assert float(found[0][1]) == data["avg_latency"] == pytest.approx(sum(data["latencies"]) / 3)
    assert list(data["percentiles"]) == ["10", "25", "50", "75", "90", "99"]
    ps = list(data["percentiles"].values())
    assert ps == sorted(ps) and min(data["latencies"]) <= ps[0] and ps[-1] <= max(data["latencies"])

    assert bench.main(["latency", "--part", "04", "--model", str(tiny), *TINY_FLAGS, "--input-len", "4",
                       "--output-len", "2", "--batch-size", "1", "--num-iters-warmup", "0", "--num-iters", "1",
                       "--output-json", str(out), "--disable-tqdm"]) == 0
    assert json.loads(out.read_text())["part"] == "part04_continuous_batching"


def test_latency_flags_follow_the_part():
    parser, subs = bench.build_parser("part15_full")
    args = parser.parse_args(["latency", "--max-num-seqs", "4"])
    assert (args.input_len, args.output_len, args.batch_size, args.num_iters_warmup, args.num_iters) == (32, 128, 8, 10, 30)
    assert args.max_num_seqs == 4 and args.enable_prefix_caching is False  # off by default, as in vLLM
    assert parser.parse_args(["latency", "--enable-prefix-caching"]).enable_prefix_caching is True
    parser04, _ = bench.build_parser("part04_continuous_batching")
    with pytest.raises(SystemExit):  # part 04 has no prefix cache, so no such flag
        parser04.parse_args(["latency", "--part", "04", "--enable-prefix-caching"])
    assert offline.part_from_argv(["latency", "--part", "4"]) == "part04_continuous_batching"


@pytest.mark.parametrize("argv, message", [
    (["--part", "99"], "no such part"),
    (["--batch-size", "0"], "at least 1"),
    (["--max-model-len", "16", "--input-len", "12", "--output-len", "8"], "exceeds the model's max_model_len 16"),
])
def test_latency_refuses_bad_flags(tiny, capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        bench.main(["latency", "--model", str(tiny), *TINY_FLAGS, "--num-iters-warmup", "0", "--num-iters", "1",
                    "--disable-tqdm", *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_throughput_cli(tiny, tmp_path, capsys):
    out = tmp_path / "thr.json"
    assert bench.main(["throughput", "--model", str(tiny), *TINY_FLAGS, "--input-len", "8", "--output-len", "4",
                       "--num-prompts", "5", "--n", "2", "--output-json", str(out)]) == 0
    printed = capsys.readouterr().out
    m = re.search(rf"^Throughput: ({FLOAT}) requests/s, ({FLOAT}) total tokens/s, ({FLOAT}) output tokens/s$",
                  printed, flags=re.M)
    assert m and "Total num prompt tokens:  40\n" in printed and "Total num output tokens:  40\n" in printed
    data = json.loads(out.read_text())
    assert {"model_id", "elapsed_time", "num_requests", "total_num_tokens", "requests_per_second",
            "tokens_per_second"} <= set(data)
    assert (data["num_requests"], data["total_num_tokens"], data["model_id"]) == (5, 80, tiny.name)
    assert data["requests_per_second"] == pytest.approx(5 / data["elapsed_time"])
    assert f"{data['requests_per_second']:.2f}" == m.group(1) and f"{data['tokens_per_second']:.2f}" == m.group(2)
