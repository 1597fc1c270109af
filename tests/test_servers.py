"""Every server through the official `openai` client and raw HTTP: parity with HF, streaming,
bad input (OpenAI-shaped 4xx, and the server keeps serving), /health during generation,
client disconnect aborting generation, and the `python -m partNN.server` entry point.

The full matrix runs once per distinct server implementation: `shared.course.server_groups()`
groups the parts by byte-identical server.py, and each group's latest part (the most machinery
under that server code) gets every test here. The other parts of a group get `test_smoke`: their
engine is proven by the engine tests (test_parity.py and the part's own file), and the same
server code over it needs only to be shown wired up."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from conftest import ORACLE, PARTS, build_app, engine_client, free_port, part_number, running_server
from shared import course

MODEL = "SmolLM2-135M-Instruct"
GROUPS = course.server_groups()
FULL_PARTS = [g[-1].name for g in GROUPS]              # the whole matrix runs on these
SMOKE_PARTS = [s.name for g in GROUPS for s in g[:-1]]  # same server.py as a later part


def streams(part: str) -> bool:
    return part_number(part) >= 2  # SSE streaming from part 02 on; part 01 refuses `stream`


def serve(part: str, llm_for):
    app = build_app(part, llm_for(part), MODEL)
    return app, running_server(app)


def pytest_generate_tests(metafunc):
    """Tests that take `server` run on every FULL_PARTS part, tests that take `streaming_server` on
    those that stream. Both come from the one module-scoped `served` fixture, so a part has one
    running server (one AsyncLLM driving its engine) at a time, shared by both kinds of test."""
    if "served" in metafunc.fixturenames:
        parts = [p for p in FULL_PARTS if streams(p)] if "streaming_server" in metafunc.fixturenames \
            else FULL_PARTS
        metafunc.parametrize("served", parts, indirect=True, scope="module")


@pytest.fixture(scope="module")
def served(request, llm_for):
    part = request.param
    app, running = serve(part, llm_for)
    with running as url:
        yield part, url, app


@pytest.fixture
def server(served):
    return served  # (part, url, app)


@pytest.fixture
def streaming_server(served):
    _, url, app = served
    return url, app


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


# The HTTP layer's tests need enough tokens to stream in many chunks and hold a stop string; the
# engines' parity over NEW_TOKENS is test_parity.py's.
HTTP_TOKENS = 16
GREEDY = dict(temperature=0, max_tokens=HTTP_TOKENS, extra_body={"ignore_eos": True})


def test_models_and_health(server):
    _, url, _ = server
    assert [m.id for m in client(url).models.list().data] == [MODEL]
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}


def concurrently(fn, items):
    """fn over items, all requests in flight at once (a server that batches runs them together;
    one that does not queues them), results in order."""
    with ThreadPoolExecutor(max_workers=max(1, len(items))) as pool:
        return list(pool.map(fn, items))


def test_completions_match_hf(server, prompt_token_ids, hf_greedy, hf_tokenizer):
    _, url, _ = server
    c = client(url)
    responses = concurrently(lambda ids: c.completions.create(model=MODEL, prompt=ids, **GREEDY),
                             prompt_token_ids)
    for ids, resp in zip(prompt_token_ids, responses):
        assert resp.choices[0].text == hf_tokenizer.decode(hf_greedy(ids, HTTP_TOKENS), skip_special_tokens=True)
        assert resp.usage.prompt_tokens == len(ids) and resp.usage.completion_tokens == HTTP_TOKENS
        assert resp.choices[0].finish_reason == "length"


def test_chat_matches_hf(server, prompt_token_ids, hf_greedy, hf_tokenizer):
    from conftest import CHAT_PROMPTS

    _, url, _ = server
    c = client(url)
    responses = concurrently(lambda text: c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": text}], **GREEDY), CHAT_PROMPTS)
    for ids, resp in zip(prompt_token_ids[4:], responses):
        assert resp.choices[0].message.content == hf_tokenizer.decode(hf_greedy(ids, HTTP_TOKENS), skip_special_tokens=True)
        assert resp.usage.prompt_tokens == len(ids)


def test_chat_stops_at_eos_and_logprobs(server):
    _, url, _ = server
    resp = client(url).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0, max_tokens=64, logprobs=True, top_logprobs=2)
    choice = resp.choices[0]
    assert choice.finish_reason == "stop" and "Paris" in choice.message.content
    content = choice.logprobs.content
    # The EOS token that ended it is reported too (as vLLM does), but is not in the text.
    assert content[-1].token == "<|im_end|>"
    assert "".join(c.token for c in content[:-1]) == choice.message.content
    for c in content:  # greedy: the chosen token is the most likely one
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob == pytest.approx(c.logprob)


def test_stop_string(server):
    _, url, _ = server
    full = client(url).completions.create(model=MODEL, prompt="Count: 1, 2, 3,", **GREEDY).choices[0].text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    resp = client(url).completions.create(model=MODEL, prompt="Count: 1, 2, 3,", stop=[stop], **GREEDY)
    assert resp.choices[0].text == full[: full.index(stop)]
    assert resp.choices[0].finish_reason == "stop"


BAD_REQUESTS = [
    ("/v1/completions", {"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "n": 1000}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10_000}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hello " * 9000, "max_tokens": 1}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 10**9]}, 400, "prompt"),
    ("/v1/completions", {}, 400, "prompt"),
    ("/v1/completions", {"model": "no-such-model", "prompt": "hi"}, 404, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, 400,
     "temperature"),
    ("/v1/chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
    # OpenAI fields we cannot honour are refused, never silently ignored (parts before 15 refuse every
    # structured format; part 15 refuses a format it does not know and a schema that is not one).
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "xml"}}, 400, "response_format"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": 3}}}, 400, "response_format"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {}}}]}, 400, "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "auto"}, 400,
     "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "functions": [{"name": "f"}]}, 400,
     "functions"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "function_call": "auto"}, 400,
     "function_call"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"not-a-token": 5}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"-1": 5}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"42": 101}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {str(10**9): 1}}, 400, "logit_bias"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"1.5": 1}}, 400,
     "logit_bias"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": None},
                                           {"role": "user", "content": "hi"}]}, 400, "messages"),
]


def check_openai_error(url, path, body, status, param):
    """The request gets `status` with an OpenAI-shaped error naming `param`, and the server still
    serves afterwards."""
    body = {"model": MODEL, **body}
    r = httpx.post(f"{url}{path}", json=body, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    # ...and the server still serves.
    ok = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 1


@pytest.mark.parametrize("path,body,status,param", BAD_REQUESTS)
def test_bad_input_gets_openai_error(server, path, body, status, param):
    part, url, _ = server
    if param == "tools" and part_number(part) >= 15:
        # Part 15 serves tools; without tool_choice they mean "auto", which a server started
        # without --enable-auto-tool-choice refuses, naming tool_choice (as vLLM does).
        param = "tool_choice"
    check_openai_error(url, path, body, status, param)


def test_malformed_json(server):
    _, url, _ = server
    r = httpx.post(f"{url}/v1/completions", content=b'{"prompt": "hi",', timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError):  # the official client sees a 400 too
        client(url).completions.create(model=MODEL, prompt="hi", max_tokens=-1)


@pytest.mark.parametrize("part", [p for p in PARTS if not streams(p)])
def test_non_streaming_part_refuses_stream(part, llm_for):
    _, running = serve(part, llm_for)
    with running as url:
        with pytest.raises(openai.BadRequestError) as e:
            client(url).completions.create(model=MODEL, prompt="hi", stream=True)
        assert e.value.body["param"] == "stream"


# ---- the other parts of a group: the same server.py, wired to this part's engine -------

@pytest.mark.parametrize("part", SMOKE_PARTS)
def test_smoke(part, llm_for, prompt_token_ids, hf_greedy, hf_tokenizer):
    """/v1/models and /health; one greedy completion equal to HF's; the same completion streamed
    (parts that stream); one bad request gets the OpenAI-shaped 400."""
    _, running = serve(part, llm_for)
    with running as url:
        c = client(url)
        assert [m.id for m in c.models.list().data] == [MODEL]
        assert httpx.get(f"{url}/health").json() == {"status": "ok"}
        ids = prompt_token_ids[4]
        resp = c.completions.create(model=MODEL, prompt=ids, **GREEDY)
        assert resp.choices[0].text == hf_tokenizer.decode(hf_greedy(ids, HTTP_TOKENS), skip_special_tokens=True)
        assert resp.usage.completion_tokens == HTTP_TOKENS and resp.choices[0].finish_reason == "length"
        if streams(part):
            chunks = [ch for ch in c.completions.create(model=MODEL, prompt=ids, stream=True, **GREEDY)
                      if ch.choices]
            assert "".join(ch.choices[0].text for ch in chunks) == resp.choices[0].text
            assert len(chunks) > 5  # really token by token
        check_openai_error(url, *BAD_REQUESTS[0])


# ---- streaming (part 02 on) -----------------------------------------------------------

def test_streamed_completion_equals_non_streamed(streaming_server, prompt_token_ids):
    url, _ = streaming_server
    c = client(url)
    prompts = prompt_token_ids[:4]
    wholes = concurrently(lambda ids: c.completions.create(model=MODEL, prompt=ids, **GREEDY).choices[0].text,
                          prompts)
    streamed = concurrently(lambda ids: list(c.completions.create(
        model=MODEL, prompt=ids, stream=True, stream_options={"include_usage": True}, **GREEDY)), prompts)
    for whole, chunks in zip(wholes, streamed):
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == whole
        assert len([ch for ch in chunks if ch.choices]) > 5  # really token by token
        assert chunks[-1].usage.completion_tokens == HTTP_TOKENS and not chunks[-1].choices


def test_streamed_chat_equals_non_streamed(streaming_server):
    url, _ = streaming_server
    c = client(url)
    msgs = [{"role": "user", "content": "Write a haiku about the sea."}]
    whole = c.chat.completions.create(model=MODEL, messages=msgs, **GREEDY).choices[0].message.content
    chunks = list(c.chat.completions.create(model=MODEL, messages=msgs, stream=True, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == whole
    assert chunks[-1].choices[0].finish_reason == "length"


def test_streaming_with_stop_string_never_leaks_it(streaming_server):
    url, _ = streaming_server
    c = client(url)
    full = c.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", **GREEDY).choices[0].text
    stop = full[10:16]
    chunks = list(c.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", stop=[stop], stream=True, **GREEDY))
    assert "".join(ch.choices[0].text for ch in chunks) == full[: full.index(stop)]


def test_raw_sse_ends_with_done(streaming_server):
    url, _ = streaming_server
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert all(json.loads(e)["object"] == "text_completion" for e in events[:-1])


def _long_stream(url: str, max_tokens: int, seen: list, stop_after: int | None = None,
                 stop: threading.Event | None = None) -> None:
    body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": max_tokens,
            "stream": True, "ignore_eos": True, "temperature": 0}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen.append(time.monotonic())
                if (stop_after is not None and len(seen) >= stop_after) or (stop and stop.is_set()):
                    return  # leaving the block closes the connection: a client disconnect


def _wait_idle(async_llm, num_aborted: int | None = None, timeout: float = 30) -> None:
    """Until no request is unfinished and, when given, the abort counter has reached num_aborted:
    a handler lets go of an aborted request (num_unfinished) before the engine thread drops it
    and counts the abort, so the first alone does not mean the second has happened."""
    deadline = time.monotonic() + timeout
    while (async_llm.num_unfinished or (num_aborted is not None and async_llm.num_aborted < num_aborted)) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert async_llm.num_unfinished == 0
    assert num_aborted is None or async_llm.num_aborted == num_aborted


def test_health_answers_during_long_generation(streaming_server):
    url, app = streaming_server
    aborted_before = engine_client(app).num_aborted
    seen: list = []
    done = threading.Event()
    t = threading.Thread(target=_long_stream, args=(url, 200, seen, None, done), daemon=True)
    t.start()
    deadline = time.monotonic() + 60
    while len(seen) < 3:  # a server that never streams fails here instead of hanging the suite
        assert t.is_alive() and time.monotonic() < deadline, f"no stream: {len(seen)} chunks"
        time.sleep(0.01)
    start = time.monotonic()
    assert httpx.get(f"{url}/health", timeout=5).status_code == 200
    latency = time.monotonic() - start
    still_generating = t.is_alive()
    done.set()  # the client goes away; the rest of the 200 tokens are not worth waiting for
    t.join(timeout=120)
    _wait_idle(engine_client(app), aborted_before + 1)  # its abort is counted before the next test counts
    assert still_generating and latency < 1.0


def test_disconnect_aborts_generation(streaming_server):
    url, app = streaming_server
    async_llm = engine_client(app)
    aborted_before = async_llm.num_aborted
    seen: list = []
    _long_stream(url, 2000, seen, stop_after=3)
    deadline = time.monotonic() + 30
    while (async_llm.num_unfinished or async_llm.num_aborted == aborted_before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert async_llm.num_unfinished == 0 and async_llm.num_aborted == aborted_before + 1
    # The engine is free again: a new request is served at once.
    start = time.monotonic()
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200 and time.monotonic() - start < 10


@pytest.mark.parametrize("part", FULL_PARTS)
def test_module_entry_point(part, tmp_path):
    """`python -m partNN.server` really starts and serves (subprocess, real CLI, the oracle tier and
    a small KV pool: the model load is most of its cost), once per distinct server.py (its CLI);
    the other parts of a group are the same server wired to their engine (test_smoke). The
    process, and anything it started, is always ended, whatever happens here."""
    root, port = Path(__file__).resolve().parent.parent, free_port()
    cmd = [sys.executable, "-m", f"{part}.server", "--port", str(port),
           "--device", ORACLE["device"], "--dtype", ORACLE["dtype"]]
    if part_number(part) >= 3:
        cmd += ["--kv-cache-memory-mb", "32"]
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:  # a file, not a pipe: a chatty server never blocks on it
        proc = subprocess.Popen(cmd, cwd=root, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, f"exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"server did not come up:\n{log_path.read_text()[-3000:]}"
            time.sleep(0.1)
        resp = client(url).completions.create(model=MODEL, prompt="The capital of France is", max_tokens=3,
                                              temperature=0)
        assert resp.choices[0].text.strip().startswith("Paris")
    finally:
        _end_process_group(proc)


def _end_process_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's own process group (it was started in a new session, so the group is
    exactly it and its children), SIGKILL if it is not gone within 10 s."""
    for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
    if proc.poll() is None:  # a leader that escaped its group (it cannot, but never leave it running)
        proc.kill()
        proc.wait(timeout=10)


def test_non_streaming_disconnect_aborts_too(streaming_server):
    url, app = streaming_server
    async_llm = engine_client(app)
    aborted_before = async_llm.num_aborted
    body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 2000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(f"{url}/v1/completions", json=body, timeout=httpx.Timeout(60, read=1.0))
    deadline = time.monotonic() + 30
    while (async_llm.num_unfinished or async_llm.num_aborted == aborted_before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert async_llm.num_unfinished == 0 and async_llm.num_aborted == aborted_before + 1


# ---- part 11's server over two engine-core processes (data parallelism) -----------------------

@pytest.fixture(scope="module")
def dp2_server():
    """The last part's server with DP=2: requests are validated in the API server, engines elsewhere."""
    from part11_ep.config import EngineConfig
    from part11_ep.core_client import DPAsyncMPClient
    from part11_ep.server import build_app as build_part11

    client = DPAsyncMPClient(EngineConfig(device="cpu", dtype="float32", kv_cache_memory_mb=64,
                                          data_parallel_size=2, num_threads=1))
    try:
        with running_server(build_part11(client, MODEL)) as url:
            yield url
    finally:
        client.shutdown()


@pytest.mark.parametrize("path,body,status,param", BAD_REQUESTS)
def test_bad_input_on_a_dp2_server(dp2_server, path, body, status, param):
    check_openai_error(dp2_server, path, body, status, param)
