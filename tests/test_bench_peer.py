"""The vLLM peer of the throughput harness, without vLLM: the wrapper (shared/bench/vllm_peer.py)
against a fake runner that speaks the vllm-peer/2 protocol (and breaks it on demand), and the
real runner (shared/bench/vllm_runner.py) against a fake `vllm` package. Each subprocess is a
bare python that imports nothing heavy, so the whole file runs in a few seconds."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from shared.bench.throughput import SystemResult, ThroughputResult, format_table, measure_system
from shared.bench.vllm_peer import PROTOCOL, RUNNER, PeerError, VllmPeerSystem, peer_python
from shared.bench.workload import BenchRequest, Workload

# Replies with token i+1000 of request i, output_len times (modes break it on purpose). It
# records every message it got in $FAKE_LOG, so a test can see what the wrapper sent.
FAKE_RUNNER = textwrap.dedent('''
    import json, os, sys, time
    mode = os.environ.get("FAKE_MODE", "ok")
    log = open(os.environ["FAKE_LOG"], "a")
    def reply(op, **body):
        sys.stdout.write(json.dumps({"protocol": "vllm-peer/2", "op": op, **body}) + "\\n")
        sys.stdout.flush()
    for line in sys.stdin:
        msg = json.loads(line)
        log.write(line); log.flush()
        op = msg["op"]
        if op == "load":
            print("fake vLLM starting up", file=sys.stderr, flush=True)
            if mode == "crash_load":
                print("fake vLLM: out of memory", file=sys.stderr, flush=True)
                sys.exit(3)
            if mode == "hang":
                time.sleep(60)
            if mode == "garbage":
                print("INFO some log line on the wrong channel", flush=True)
                continue
            if mode == "wrong_protocol":
                sys.stdout.write(json.dumps({"protocol": "other/9", "op": op, "ok": True}) + "\\n")
                sys.stdout.flush()
                continue
            reply(op, ok=True, load_s=1.5, versions={"vllm": "0.0.fake", "torch": "x"},
                  settings={"dtype": msg["dtype"], "block_size": 128, "max_model_len": msg["max_model_len"],
                            "env": {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}})
        elif op == "reset":
            reply(op, ok=True, reset=True)
        elif op == "generate":
            reqs = msg["requests"]
            if mode == "fail_generate":
                reply(op, ok=False, error="ValueError: boom", traceback="Traceback: boom\\n")
                continue
            out = [[1000 + i] * r["output_len"] for i, r in enumerate(reqs)]
            if mode == "drop_one" and len(reqs) > 1:
                out = out[:-1]
            if mode == "short" and len(reqs) > 1:
                out[0] = out[0][:-1]
            if mode == "not_ids":
                out[0] = ["a"]
            reply(op, ok=True, wall_s=0.25, token_ids=out)
        elif op == "close":
            reply(op, ok=True)
            break
''')


@pytest.fixture
def fake(tmp_path, monkeypatch):
    runner = tmp_path / "fake_runner.py"
    runner.write_text(FAKE_RUNNER)
    log = tmp_path / "sent.jsonl"
    monkeypatch.setenv("FAKE_LOG", str(log))

    def make(mode="ok", **kw):
        monkeypatch.setenv("FAKE_MODE", mode)
        kw.setdefault("load_timeout_s", 20)
        kw.setdefault("generate_timeout_s", 20)
        kw.setdefault("log_path", tmp_path / "peer.log")
        return VllmPeerSystem(sys.executable, tmp_path / "model", "float32", threads=2,
                              max_model_len=8192, runner=runner, **kw)

    make.sent = lambda: [json.loads(line) for line in log.read_text().splitlines()]
    return make


def _workload(n=3):
    reqs = [BenchRequest(list(range(10 + i, 20 + i)), output_len=4 + i) for i in range(n)]
    return Workload(reqs, (10, 10), (4, 4 + n - 1), seed=0, vocab_size=100)


def test_peer_round_trip_through_the_harness(fake):
    w = _workload()
    system = fake("ok")
    res = measure_system(system, w, progress=False)
    assert res.error is None, res.notes.get("traceback")
    assert res.token_ids == [[1000 + i] * r.output_len for i, r in enumerate(w.requests)]
    assert res.lengths_ok and res.output_tokens == w.output_tokens
    # The runner's own clock is the wall time; the harness's round trip is kept beside it.
    assert res.wall_s == pytest.approx(0.25)
    assert res.output_tokens_per_s == pytest.approx(w.output_tokens / 0.25)
    assert res.notes["harness_wall_s"] >= 0
    assert res.notes["vllm"] == "0.0.fake" and res.notes["startup_s"] == 1.5
    assert res.load_s is not None and res.load_s > 0
    assert system.proc is None  # closed

    sent = fake.sent()
    assert [m["op"] for m in sent] == ["load", "generate", "generate", "close"]
    load = sent[0]
    assert (load["dtype"], load["threads"], load["max_model_len"]) == ("float32", 2, 8192)
    assert load["enforce_eager"] is True and load["kv_cache_bytes"] == 1 << 30
    # The harness's warm-up is a real generate: the first (up to 8) prompts whole, 2 outputs each.
    assert sent[1]["requests"] == [{"prompt_token_ids": r.prompt_token_ids, "output_len": 2} for r in w.requests[:8]]
    assert sent[2]["requests"] == [{"prompt_token_ids": r.prompt_token_ids, "output_len": r.output_len}
                                   for r in w.requests]


def test_rounds_reset_the_peer_between_them(fake):
    res = measure_system(fake("ok"), _workload(), progress=False, rounds=3)
    assert res.error is None, res.notes.get("traceback")
    assert [m["op"] for m in fake.sent()] == ["load", "generate", "generate", "reset", "generate", "reset",
                                              "generate", "close"]
    assert res.notes["round_walls_s"] == [0.25, 0.25, 0.25]


def test_dtype_given_as_torch_dtype_is_sent_by_name():
    import torch

    assert VllmPeerSystem(sys.executable, ".", torch.bfloat16).load_msg["dtype"] == "bfloat16"


def test_output_shorter_than_asked_is_flagged_not_credited(fake):
    w = _workload()
    res = measure_system(fake("short"), w, progress=False)
    assert res.error is None
    assert not res.lengths_ok
    assert res.output_tokens == w.output_tokens - 1


@pytest.mark.parametrize("mode, message", [
    ("drop_one", "vLLM peer returned 2 outputs for 3 requests"),
    ("not_ids", "output 0 is not a list of token ids"),
    ("fail_generate", "vLLM peer failed at 'generate': ValueError: boom"),
    ("crash_load", "vLLM peer runner exited (code 3) during 'load'"),
    ("garbage", "answered 'load' out of protocol"),
    ("wrong_protocol", "want protocol vllm-peer/2"),
])
def test_broken_peer_fails_with_a_clear_error(fake, mode, message):
    system = fake(mode)
    res = measure_system(system, _workload(), progress=False)
    assert res.error is not None and message in res.error, res.error
    assert res.token_ids is None and res.wall_s == 0.0
    assert system.proc is None
    # The table shows one line per failed system: the first line of the error.
    table = format_table(ThroughputResult(_workload().describe(), {
        "device": "cpu", "dtype": "float32", "cpu_threads": 2, "torch": "t", "transformers": "t"},
        [SystemResult("ours"), res]))
    assert f"vllm               FAILED: {res.error.splitlines()[0]}" in table
    assert "--- last lines" not in table


def test_the_table_gives_the_round_by_round_ratio():
    """With interleaved rounds, each pair's ratio besides the best rounds' (which can fall in
    different spells of a noisy machine): the median and the range of peer wall / ours."""
    machine = {"device": "cpu", "dtype": "float32", "cpu_threads": 2, "torch": "t", "transformers": "t"}
    ours = SystemResult("ours", wall_s=10.0, notes={"round_walls_s": [10.0, 20.0, 12.0]})
    peer = SystemResult("vllm", wall_s=13.0, notes={"round_walls_s": [13.0, 22.0, 30.0]})
    table = format_table(ThroughputResult(_workload().describe(), machine, [ours, peer]))
    assert "round by round: vllm's wall over ours' 1.30x (median of 3), 1.10-2.50x" in table
    single = SystemResult("vllm", wall_s=13.0)  # one round: no such line
    assert "round by round" not in format_table(ThroughputResult(_workload().describe(), machine, [ours, single]))


def test_crash_shows_the_runner_log(fake):
    res = measure_system(fake("crash_load"), _workload(), progress=False)
    assert "fake vLLM: out of memory" in res.error  # the log tail rides along, after line 1


def test_silent_peer_times_out_and_is_killed(fake):
    system = fake("hang", load_timeout_s=0.5)
    with pytest.raises(PeerError, match="no answer to 'load' within 0.5 s"):
        system.load()
    proc = system.proc
    system.close()
    assert proc.poll() is not None


def test_missing_python_says_how_to_point_at_the_peer(tmp_path):
    system = VllmPeerSystem(tmp_path / "nope" / "python", tmp_path)
    with pytest.raises(PeerError, match="VLLM_PEER_PYTHON"):
        system.load()
    system.close()


def test_generate_before_load_is_an_error(fake):
    with pytest.raises(PeerError, match="not running"):
        fake("ok").generate(_workload().requests)


def test_peer_python_flag_beats_the_environment(monkeypatch):
    monkeypatch.setenv("VLLM_PEER_PYTHON", "/env/python")
    assert peer_python("/flag/python") == "/flag/python"
    assert peer_python(None) == "/env/python"
    monkeypatch.delenv("VLLM_PEER_PYTHON")
    assert peer_python(None) is None


# ---------------------------------------------------------------- the real runner, fake vllm

FAKE_VLLM = textwrap.dedent('''
    import os
    __version__ = "0.0.fake"
    class SamplingParams:
        def __init__(self, temperature, max_tokens, ignore_eos):
            assert temperature == 0.0 and ignore_eos is True
            self.max_tokens = max_tokens
    class _Out:
        def __init__(self, ids): self.token_ids = ids
    class _Req:
        def __init__(self, ids): self.outputs = [_Out(ids)]
    class LLM:
        def __init__(self, **kw):
            self.kw = kw
            print("vllm log line on stdout", flush=True)  # must not reach the reply channel
            os.system("echo child process output")
            if kw["model"] == "broken":
                raise RuntimeError("cannot load broken")
        def generate(self, prompts, params, use_tqdm=False):
            return [_Req([p["prompt_token_ids"][-1]] * sp.max_tokens) for p, sp in zip(prompts, params)]
        def reset_prefix_cache(self):
            return True
''')
FAKE_TORCH = "__version__ = '0.0.faketorch'\ndef set_num_threads(n): pass\n"


@pytest.fixture
def fake_vllm_path(tmp_path):
    root = tmp_path / "site"
    (root / "vllm").mkdir(parents=True)
    (root / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    (root / "torch.py").write_text(FAKE_TORCH)
    return root


def _run_runner(fake_vllm_path, ops, tmp_path):
    inp, out = tmp_path / "ops.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(o) + "\n" for o in ops))
    env = {**os.environ, "PYTHONPATH": str(fake_vllm_path)}
    proc = subprocess.run([sys.executable, str(RUNNER), "--input", str(inp), "--output", str(out)],
                          env=env, capture_output=True, text=True, timeout=30)
    return proc, [json.loads(line) for line in out.read_text().splitlines()]


def test_real_runner_speaks_the_protocol(fake_vllm_path, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer.json").write_text("{}")
    ops = [{"op": "load", "model": str(model), "dtype": "float32", "threads": 2, "max_model_len": 64,
            "kv_cache_bytes": 1 << 20, "max_num_seqs": None, "load_format": "auto"},
           {"op": "generate", "requests": [{"prompt_token_ids": [5, 6, 7], "output_len": 3},
                                           {"prompt_token_ids": [9], "output_len": 1}]},
           {"op": "bogus"},
           {"op": "reset"},
           {"op": "close"}]
    proc, replies = _run_runner(fake_vllm_path, ops, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert [(r["protocol"], r["op"], r["ok"]) for r in replies] == [
        (PROTOCOL, "load", True), (PROTOCOL, "generate", True), (PROTOCOL, "bogus", False),
        (PROTOCOL, "reset", True), (PROTOCOL, "close", True)]
    assert replies[3]["reset"] is True
    load, gen = replies[0], replies[1]
    assert load["versions"]["vllm"] == "0.0.fake"
    kw = load["settings"]["llm_kwargs"]
    assert kw["dtype"] == "float32" and kw["max_model_len"] == 64 and kw["enforce_eager"] is True
    assert kw["kv_cache_memory_bytes"] == 1 << 20 and "max_num_seqs" not in kw  # None: vLLM's default
    assert kw["tokenizer"] == str(model) and "skip_tokenizer_init" not in kw and "load_format" not in kw
    assert load["settings"]["env"]["OMP_NUM_THREADS"] == "2"
    assert gen["token_ids"] == [[7, 7, 7], [9]] and gen["wall_s"] >= 0
    assert "unknown op 'bogus'" in replies[2]["error"]
    # Prints of vLLM and of its children went to stderr, never the reply channel.
    assert "vllm log line on stdout" in proc.stderr and "child process output" in proc.stderr


def test_real_runner_random_weights_need_no_tokenizer(fake_vllm_path, tmp_path):
    config_only = tmp_path / "config_only"
    config_only.mkdir()
    (config_only / "config.json").write_text("{}")
    proc, replies = _run_runner(fake_vllm_path, [{"op": "load", "model": str(config_only),
                                                  "load_format": "dummy"}], tmp_path)
    assert proc.returncode == 0, proc.stderr
    kw = replies[0]["settings"]["llm_kwargs"]
    assert kw["load_format"] == "dummy" and kw["skip_tokenizer_init"] is True and "tokenizer" not in kw


def test_real_runner_reports_a_failed_load_and_exits(fake_vllm_path, tmp_path):
    proc, replies = _run_runner(fake_vllm_path, [{"op": "load", "model": "broken"},
                                                 {"op": "generate", "requests": []}], tmp_path)
    assert proc.returncode == 1
    assert len(replies) == 1 and not replies[0]["ok"]
    assert "RuntimeError: cannot load broken" in replies[0]["error"]


def test_wrapper_drives_the_real_runner(fake_vllm_path, tmp_path):
    system = VllmPeerSystem(sys.executable, "m", "float32", threads=2, max_model_len=64,
                            env={"PYTHONPATH": str(fake_vllm_path)}, load_timeout_s=20,
                            generate_timeout_s=20)
    w = _workload(2)
    res = measure_system(system, w, progress=False)
    assert res.error is None, res.notes.get("traceback")
    assert res.token_ids == [[r.prompt_token_ids[-1]] * r.output_len for r in w.requests]
    assert res.notes["vllm"] == "0.0.fake" and res.notes["omp_bind"] == "nobind"
    assert not Path(system.log_path).exists()  # a clean run leaves no log behind
