"""Part 15's server features, on a tiny random Llama (`--load-format dummy`: config.json and the
embedded model's tokenizer, so that every server starts in seconds):

- /tokenize and /detokenize against HF's tokenizer (completion and chat forms, token strings, the
  ids a chat completion runs), ids outside the vocabulary refused; /version is pyproject's.
- --api-key / $VLLM_API_KEY: /v1 needs the key (401 in OpenAI's shape without it), the rest stays open.
- CORS: a preflight from an allowed origin is answered, one from another origin is not.
- X-Request-Id: echoed, and the response's id; a new one when the client sends none.
- Configuration: every invalid combination named at once, before any model load; the effective summary.
- Graceful shutdown: SIGTERM with a stream in flight lets it finish and exits 0; one that outlasts
  --shutdown-timeout is aborted (finish_reason "abort", [DONE]) and the data-parallel engine
  processes are gone; in process, the abort frees every KV block."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import tomllib
from pathlib import Path

import httpx
import openai
import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from conftest import free_port, pool_is_full, running_server
from test_part13_disagg import end, wait_healthy

ROOT = Path(__file__).resolve().parent.parent
MODEL = "tiny"
KEY = "sk-test-key"
ORIGIN = "https://app.example"
TINY = ["--load-format", "dummy", "--device", "cpu", "--dtype", "float32", "--kv-cache-memory-mb", "16"]


def tiny_model_folder(path: Path) -> Path:
    """test_load_format.py's tiny Llama (config only) with the embedded model's tokenizer, and a
    context long enough for generations that outlast a shutdown timeout."""
    from transformers import LlamaConfig

    from shared.tokenizer import TOKENIZER_FILES
    from shared.weights import resolve_model_path

    LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=8192).save_pretrained(path)
    embedded = resolve_model_path(None)
    for name in (*TOKENIZER_FILES, "special_tokens_map.json", "chat_template.jinja"):
        if (embedded / name).exists():
            shutil.copy(embedded / name, path / name)
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return tiny_model_folder(tmp_path_factory.mktemp("tiny"))


def tiny_llm(folder: Path):
    from part15_full import LLM

    return LLM(model=str(folder), load_format="dummy", device="cpu", dtype="float32", kv_cache_memory_mb=16)


@pytest.fixture(scope="module")
def served(tiny):
    """An in-process server with a key, one allowed origin and request-id headers."""
    from part15_full.async_llm import AsyncLLM
    from part15_full.cli_args import FrontendArgs
    from part15_full.server import build_app

    frontend = FrontendArgs(api_key=[KEY], allowed_origins=[ORIGIN], allow_credentials=True,
                            enable_request_id_headers=True)
    with running_server(build_app(AsyncLLM(tiny_llm(tiny).engine), MODEL, frontend=frontend)) as url:
        yield url


AUTH = {"Authorization": f"Bearer {KEY}"}


# ---- /tokenize, /detokenize, /version -------------------------------------------------------

@pytest.mark.parametrize("special", [True, False])
def test_tokenize_counts_what_hf_counts(served, hf_tokenizer, special):
    text = "The capital of France is Paris. Ünïcödé, too!"
    r = httpx.post(f"{served}/tokenize", json={"prompt": text, "add_special_tokens": special,
                                               "return_token_strs": True})
    want = hf_tokenizer(text, add_special_tokens=special).input_ids
    assert r.status_code == 200
    body = r.json()
    assert body["tokens"] == want and body["count"] == len(want) and body["max_model_len"] == 8192
    assert body["token_strs"] == hf_tokenizer.convert_ids_to_tokens(want)
    assert httpx.post(f"{served}/tokenize", json={"prompt": text}).json().get("token_strs") is None


def test_tokenize_chat_gives_the_ids_a_chat_completion_runs(served, hf_tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    body = httpx.post(f"{served}/tokenize", json={"model": MODEL, "messages": messages}).json()
    want = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert body["tokens"] == want and body["count"] == len(want)
    chat = httpx.post(f"{served}/v1/chat/completions", headers=AUTH,
                      json={"model": MODEL, "messages": messages, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == body["count"]
    no_prompt = httpx.post(f"{served}/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert no_prompt["count"] < body["count"]  # the assistant header is the template's generation prompt


def test_detokenize_round_trips_and_refuses_ids_outside_the_vocabulary(served):
    text = "<|im_start|>user\nHello, wörld!<|im_end|>"  # special tokens come back too
    ids = httpx.post(f"{served}/tokenize", json={"prompt": text}).json()["tokens"]
    assert httpx.post(f"{served}/detokenize", json={"tokens": ids}).json() == {"prompt": text}
    for bad in (49152, -1):
        r = httpx.post(f"{served}/detokenize", json={"tokens": [ids[0], bad]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    r = httpx.post(f"{served}/tokenize", json={"model": "another-model", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_version_is_the_packages(served):
    want = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert httpx.get(f"{served}/version").json() == {"version": want}


# ---- API keys, CORS, request ids --------------------------------------------------------------

def test_v1_routes_need_the_api_key_and_the_rest_stays_open(served):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):  # no scheme: refused too
        r = httpx.post(f"{served}/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, headers=headers)
        assert r.status_code == 401, headers
        assert r.json()["error"]["code"] == "invalid_api_key" and set(r.json()["error"]) == \
            {"message", "type", "param", "code"}
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{served}/v1", api_key="wrong", max_retries=0).models.list()
    assert [m.id for m in openai.OpenAI(base_url=f"{served}/v1", api_key=KEY).models.list().data] == [MODEL]
    for path in ("/health", "/version"):
        assert httpx.get(f"{served}{path}").status_code == 200
    assert httpx.post(f"{served}/tokenize", json={"prompt": "Hi"}).status_code == 200


def test_api_key_from_the_environment_and_the_flag_wins(monkeypatch):
    from part15_full.server import FrontendArgs, parse_args

    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert FrontendArgs.from_cli_args(parse_args([])).api_keys == ["from-env"]
    assert FrontendArgs.from_cli_args(parse_args(["--api-key", "a", "b"])).api_keys == ["a", "b"]
    monkeypatch.delenv("VLLM_API_KEY")
    assert FrontendArgs.from_cli_args(parse_args([])).api_keys == []
    defaults = parse_args([])
    assert (defaults.allowed_origins, defaults.allowed_methods, defaults.allowed_headers) == (["*"], ["*"], ["*"])
    assert parse_args(["--allowed-methods", '["GET", "POST"]']).allowed_methods == ["GET", "POST"]
    with pytest.raises(SystemExit):
        parse_args(["--allowed-origins", "not json"])


def test_cors_preflight_answers_the_allowed_origin_only(served):
    ask = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
    ok = httpx.options(f"{served}/v1/completions", headers={"Origin": ORIGIN, **ask})  # no key: preflights carry none
    assert ok.status_code == 200
    assert ok.headers["access-control-allow-origin"] == ORIGIN
    assert ok.headers["access-control-allow-credentials"] == "true"
    assert "POST" in ok.headers["access-control-allow-methods"]
    other = httpx.options(f"{served}/v1/completions", headers={"Origin": "https://evil.example", **ask})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    # The actual request: the page may read the answer, a refusal included.
    r = httpx.post(f"{served}/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, headers={"Origin": ORIGIN})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == ORIGIN


def test_request_id_is_echoed_and_names_the_response(served):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    r = httpx.post(f"{served}/v1/completions", json=body, headers={**AUTH, "X-Request-Id": "trace-42"})
    assert r.headers["x-request-id"] == "trace-42" and r.json()["id"] == "cmpl-trace-42"
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True}
    with httpx.stream("POST", f"{served}/v1/chat/completions", json=chat,
                      headers={**AUTH, "X-Request-Id": "trace-43"}) as s:
        assert s.headers["x-request-id"] == "trace-43"
        ids = {json.loads(line[6:])["id"] for line in s.iter_lines() if line.startswith("data: {")}
    assert ids == {"chatcmpl-trace-43"}
    r = httpx.post(f"{served}/v1/completions", json=body, headers=AUTH)  # none sent: the server's own
    assert r.json()["id"] == f"cmpl-{r.headers['x-request-id']}" and len(r.headers["x-request-id"]) == 32
    assert httpx.get(f"{served}/health").headers["x-request-id"]  # every response, refusals included
    # Two clients may send the same id at once: both are served (the engine's ids stay unique).
    with httpx.Client(headers={**AUTH, "X-Request-Id": "same"}, timeout=60) as c:
        with httpx.Client(headers={**AUTH, "X-Request-Id": "same"}, timeout=60) as d:
            results = []
            threads = [threading.Thread(target=lambda cl=cl: results.append(cl.post(
                f"{served}/v1/completions", json={**body, "max_tokens": 20, "ignore_eos": True}))) for cl in (c, d)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    assert [r.status_code for r in results] == [200, 200]
    assert all(r.json()["usage"]["completion_tokens"] == 20 for r in results)


def test_request_id_without_the_header_flag():
    """Without --enable-request-id-headers, a client's X-Request-Id still names the request (as in
    vLLM), but no response carries the header: model-free, on an app with one route."""
    from part15_full.cli_args import FrontendArgs
    from part15_full.graceful_shutdown import GracefulShutdown
    from part15_full.middleware import base_request_id, install_middleware

    for flag in (False, True):
        app = FastAPI()
        install_middleware(app, FrontendArgs(enable_request_id_headers=flag), GracefulShutdown(0))

        @app.get("/id")
        async def rid(raw: Request):
            return base_request_id(raw.headers)

        with TestClient(app) as c:
            r = c.get("/id", headers={"X-Request-Id": "mine"})
            assert r.json() == "mine" and r.headers.get("x-request-id") == ("mine" if flag else None)
            r = c.get("/id")
            assert (r.headers.get("x-request-id") == r.json()) if flag else "x-request-id" not in r.headers


# ---- configuration ---------------------------------------------------------------------------

BAD = [  # (overrides, the flags the message must name)
    (dict(preemption_mode="swap", speculative_method="draft_model", kv_offloading_size=1.0),
     ["--preemption-mode swap", "--speculative-method draft_model"]),
    (dict(preemption_mode="swap"), ["--preemption-mode swap", "--kv-offloading-size"]),
    (dict(kv_transfer_config='{"kv_connector": "NixlConnector"}', kv_offloading_size=2.0),
     ["--kv-offloading-size", "--kv-transfer-config"]),
    (dict(kv_transfer_config='{"kv_connector": "LMCacheConnector"}'), ["--kv-transfer-config", "LMCacheConnector"]),
    (dict(kv_transfer_config='{"kv_connector": "NixlConnector", "kv_role": "kv_sideways"}'),
     ["--kv-transfer-config", "kv_role"]),
    (dict(kv_transfer_config="{not json"), ["--kv-transfer-config"]),
    (dict(quantization="fp8"), ["--quantization", "int8, int4"]),
    (dict(structured_outputs_backend="outlines"), ["--structured-outputs-backend", "auto, xgrammar, course"]),
    (dict(enable_expert_parallel=True), ["--enable-expert-parallel", "--tensor-parallel-size"]),
    (dict(tensor_parallel_size=2, distributed_executor_backend="uni"),
     ["--tensor-parallel-size", "--distributed-executor-backend mp"]),
    (dict(data_parallel_size=4, data_parallel_size_local=2), ["--data-parallel-rpc-port"]),
    (dict(data_parallel_size=2, tensor_parallel_size=4, nnodes=2, node_rank=0, master_addr="10.0.0.1"),
     ["--data-parallel-size 2", "--nnodes 2", "--data-parallel-size-local"]),
    (dict(speculative_model="some/draft"), ["--speculative-model", "--speculative-method draft_model"]),
    (dict(speculative_method="ngram", prompt_lookup_min=4, prompt_lookup_max=2), ["--prompt-lookup-min"]),
    (dict(max_num_seqs=2048), ["--max-num-batched-tokens", "--max-num-seqs"]),
    (dict(enable_chunked_prefill=False, max_num_batched_tokens=512, max_model_len=4096),
     ["--no-enable-chunked-prefill", "--max-num-batched-tokens", "--max-model-len"]),
    (dict(routing_policy="random"), ["--routing-policy"]),
    (dict(dtype="int3"), ["--dtype"]),
]


@pytest.mark.parametrize("overrides,flags", BAD, ids=[",".join(o) for o, _ in BAD])
def test_validate_names_the_flags(overrides, flags):
    from part15_full.config import EngineConfig

    with pytest.raises(ValueError) as e:
        EngineConfig(**overrides).validate()
    assert all(f in str(e.value) for f in flags), str(e.value)


def test_validate_collects_every_problem_and_runs_before_the_model_loads(capsys):
    from part15_full.config import EngineConfig
    from part15_full.server import main

    EngineConfig().validate()  # the defaults are valid
    EngineConfig(data_parallel_size=4, data_parallel_size_local=2, data_parallel_rpc_port=13345).validate()
    with pytest.raises(ValueError) as e:
        EngineConfig(quantization="fp8", routing_policy="random", enable_expert_parallel=True).validate()
    assert str(e.value).count("\n  - ") == 3
    # A model path that does not exist: a server that loaded first would fail on it instead.
    with pytest.raises(SystemExit) as e:
        main(["--model", "/does/not/exist", "--preemption-mode", "swap"])
    assert "--preemption-mode swap needs a host tier" in str(e.value.code) and "/does/not/exist" not in str(e.value.code)


def test_summary_shows_what_the_defaults_resolved_to():
    from part15_full.config import EngineConfig

    text = EngineConfig(device="cpu").summary(max_model_len=4096, num_blocks=2047)
    assert "cpu, float32" in text and "= 2047 blocks" in text and "max_model_len 4096" in text
    assert "async scheduling on" in text and "step budget 1024 tokens" in text and "prefix caching on" in text
    spec = EngineConfig(device="cpu", speculative_method="ngram", enable_chunked_prefill=False).summary(4096)
    assert "async scheduling off" in spec and "step budget 4096 tokens" in spec and "ngram, k=4" in spec
    assert "host tier 2 GiB (arc)" in EngineConfig(kv_offloading_size=2, kv_offloading_eviction_policy="arc").summary()


def test_the_configurations_names_are_those_of_the_engines_registries():
    """config.py names the choices it checks without importing the engine; where the engine maps
    the names to classes of its own, the two lists must not drift apart."""
    from part15_full.cache_policy import CACHE_POLICIES
    from part15_full.config import KV_CONNECTORS, KV_OFFLOADING_EVICTION_POLICIES
    from part15_full.kv_connector_factory import KVConnectorFactory

    assert sorted(KV_OFFLOADING_EVICTION_POLICIES) == sorted(CACHE_POLICIES)
    assert sorted(KV_CONNECTORS) == KVConnectorFactory.names()
    from part15_full.config import REASONING_PARSERS
    from part15_full.reasoning_parsers import ReasoningParserManager

    assert sorted(REASONING_PARSERS) == sorted(ReasoningParserManager.reasoning_parsers)


# ---- graceful shutdown -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def processes(tiny, tmp_path_factory):
    """The two servers the SIGTERM tests end, started together (their start-ups overlap): one
    that drains for up to 60 s, one with two data-parallel engine processes that drains for 1 s."""
    logs = tmp_path_factory.mktemp("servers")
    flags = {"drain": ["--shutdown-timeout", "60"],
             "dp": ["--shutdown-timeout", "1", "--data-parallel-size", "2", "--num-threads", "1"]}
    started = {}
    try:
        for name, extra in flags.items():
            port = free_port()
            cmd = [sys.executable, "-m", "part15_full.server", "--model", str(tiny), "--served-model-name", MODEL,
                   "--port", str(port), *TINY, *extra]
            with open(logs / f"{name}.log", "wb") as f:
                proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
            started[name] = (proc, f"http://127.0.0.1:{port}", logs / f"{name}.log")
        for proc, url, log in started.values():
            wait_healthy(url, [proc], log)
        yield started
    finally:
        end([proc for proc, _, _ in started.values()])


def stream_in_thread(url: str, max_tokens: int, events: list) -> threading.Thread:
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}

    def run() -> None:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            events.extend(line[6:] for line in r.iter_lines() if line.startswith("data: "))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    deadline = time.monotonic() + 60
    while len(events) < 3:  # streaming: the request is in flight
        assert t.is_alive() and time.monotonic() < deadline, events
        time.sleep(0.01)
    return t


def wait_draining(url: str) -> None:
    """Until the server answers 503 (its signal handler has run); a new request gets 503 too."""
    deadline = time.monotonic() + 10
    while httpx.get(f"{url}/health").status_code != 503:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1})
    assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"


def children_of(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def test_sigterm_lets_a_stream_in_flight_finish_and_exits_0(processes):
    proc, url, log = processes["drain"]
    events: list = []
    # 500 tokens: 500 engine steps, while the checks below take a signal and three requests.
    t = stream_in_thread(url, 500, events)
    proc.send_signal(signal.SIGTERM)  # the server alone, as `docker stop` or Kubernetes do
    wait_draining(url)
    t.join(timeout=60)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == 500
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert proc.wait(timeout=30) == 0
    text = log.read_text()
    assert "effective configuration" in text
    assert "switches:\n" in text and "VLLM_COURSE_CPU_RUNNER=True" in text  # envs.summary() at start-up


def test_sigterm_past_the_timeout_aborts_and_the_dp_engines_exit(processes):
    proc, url, _ = processes["dp"]
    engines = children_of(proc.pid)
    assert len(engines) >= 2  # the two engine-core processes (and multiprocessing's helpers)
    events: list = []
    t = stream_in_thread(url, 6000, events)  # far more steps than a second holds
    signalled = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    # No wait_draining here: the 503s while draining are the 60 s server's test, since a 1 s window
    # can close before a loaded machine's first poll (the poll then met a closed port, not a 503).
    t.join(timeout=60)
    waited = time.monotonic() - signalled
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert reasons[-1] == "abort" and reasons.count("abort") == 1
    assert chunks[-1]["usage"]["completion_tokens"] < 6000
    assert 1.0 <= waited < 30
    assert proc.wait(timeout=30) == 0
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() for pid in engines) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(Path(f"/proc/{pid}").exists() for pid in engines)


def test_the_abort_frees_every_kv_block(tiny):
    """In process, to read the pool: a stream (n=2) and a non-streamed request outlast the timeout;
    both end with finish_reason abort for every choice, and every block is back in the pool."""
    from part15_full.async_llm import AsyncLLM
    from part15_full.cli_args import FrontendArgs
    from part15_full.server import build_app

    llm = tiny_llm(tiny)
    client = AsyncLLM(llm.engine)
    app = build_app(client, MODEL, frontend=FrontendArgs(shutdown_timeout=0.5))
    drained = threading.Event()
    with running_server(app) as url:
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 6000, "ignore_eos": True, "n": 2}
        whole: list = []
        post = threading.Thread(target=lambda: whole.append(httpx.post(f"{url}/v1/completions", json=body,
                                                                       timeout=60)))
        post.start()
        events: list = []
        t = stream_in_thread(url, 6000, events)
        deadline = time.monotonic() + 30
        while client.num_unfinished < 2:  # both requests are in the engine
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert llm.engine.kv_cache_manager.req_to_blocks  # blocks are held
        app.state.shutdown.begin(on_drained=drained.set)
        assert drained.wait(30)
        t.join(timeout=10)
        post.join(timeout=10)
        chunks = [json.loads(e) for e in events[:-1]]
        assert events[-1] == "[DONE]" and [c for c in chunks if c["choices"]][-1]["choices"][0]["finish_reason"] == "abort"
        assert [c["finish_reason"] for c in whole[0].json()["choices"]] == ["abort", "abort"]
        assert app.state.shutdown.num_aborted == 2 and app.state.shutdown.in_flight == 0
        deadline = time.monotonic() + 10  # the engine thread drops aborted requests before its next step
        while (client.num_unfinished or not pool_is_full(llm)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.num_unfinished == 0 and pool_is_full(llm)


def test_a_second_signal_skips_the_wait_and_only_unfinished_choices_abort():
    """Model-free: an engine client whose choice 0 finishes and choice 1 never does."""
    from shared.outputs import CompletionOutput, RequestOutput

    from part15_full.graceful_shutdown import AbortableClient, GracefulShutdown

    class Forever:
        closed = False

        async def generate(self, request):
            try:
                yield RequestOutput("r", None, [1], [CompletionOutput(0, "a", [7], finish_reason="stop")])
                await asyncio.Event().wait()
            finally:
                Forever.closed = True

    shutdown, drained = GracefulShutdown(timeout_s=60), threading.Event()
    request = type("R", (), {"request_id": "r", "prompt": None, "prompt_token_ids": [1],
                             "sampling_params": type("P", (), {"n": 2})()})()

    async def consume() -> list:
        shutdown.in_flight = 1
        got = []
        async for delta in AbortableClient(Forever(), shutdown).generate(request):
            got.append(delta)
            if len(got) == 1:
                await asyncio.to_thread(shutdown.begin, drained.set)
                await asyncio.to_thread(shutdown.begin, drained.set)  # the second: abort now
        shutdown.in_flight = 0
        return got

    start_s = time.monotonic()
    got = asyncio.run(consume())
    assert drained.wait(5) and time.monotonic() - start_s < 5  # not the 60 s timeout
    assert [(c.index, c.finish_reason) for c in got[-1].outputs] == [(1, "abort")] and got[-1].finished
    assert Forever.closed  # the inner generation was closed: its engine aborts it
