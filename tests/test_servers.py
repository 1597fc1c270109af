"""Every server through the official `openai` client and raw HTTP: parity with HF, streaming,
bad input (OpenAI-shaped 4xx, and the server keeps serving), /health during generation,
client disconnect aborting generation, and the `python -m partNN.server` entry point."""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from conftest import free_port, running_server

MODEL = "SmolLM2-135M-Instruct"
PARTS = ["part01_simple_server", "part02_streaming", "part03_paged_attention", "part04_continuous_batching"]
STREAMING_PARTS = PARTS[1:]


def llm_fixture(part: str) -> str:
    return f"llm{part[4:6]}"  # part03_paged_attention -> llm03 (tests/conftest.py)


@pytest.fixture(scope="module", params=PARTS)
def server(request):
    part = request.param
    llm = request.getfixturevalue(llm_fixture(part))
    app = importlib.import_module(f"{part}.server").build_app(llm, MODEL)
    with running_server(app) as url:
        yield part, url, app


@pytest.fixture(scope="module", params=STREAMING_PARTS)
def streaming_server(request):
    llm = request.getfixturevalue(llm_fixture(request.param))
    app = importlib.import_module(f"{request.param}.server").build_app(llm, MODEL)
    with running_server(app) as url:
        yield url, app


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


GREEDY = dict(temperature=0, max_tokens=32, extra_body={"ignore_eos": True})


def test_models_and_health(server):
    _, url, _ = server
    assert [m.id for m in client(url).models.list().data] == [MODEL]
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}


def test_completions_match_hf(server, prompt_token_ids, hf_greedy, hf_tokenizer):
    _, url, _ = server
    for ids in prompt_token_ids:
        resp = client(url).completions.create(model=MODEL, prompt=ids, **GREEDY)
        assert resp.choices[0].text == hf_tokenizer.decode(hf_greedy(ids), skip_special_tokens=True)
        assert resp.usage.prompt_tokens == len(ids) and resp.usage.completion_tokens == 32
        assert resp.choices[0].finish_reason == "length"


def test_chat_matches_hf(server, prompt_token_ids, hf_greedy, hf_tokenizer):
    from conftest import CHAT_PROMPTS

    _, url, _ = server
    for text, ids in zip(CHAT_PROMPTS, prompt_token_ids[4:]):
        resp = client(url).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": text}], **GREEDY)
        assert resp.choices[0].message.content == hf_tokenizer.decode(hf_greedy(ids), skip_special_tokens=True)
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
]


@pytest.mark.parametrize("path,body,status,param", BAD_REQUESTS)
def test_bad_input_gets_openai_error(server, path, body, status, param):
    _, url, _ = server
    body = {"model": MODEL, **body}
    r = httpx.post(f"{url}{path}", json=body, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    # ...and the server still serves.
    ok = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 1


def test_malformed_json(server):
    _, url, _ = server
    r = httpx.post(f"{url}/v1/completions", content=b'{"prompt": "hi",', timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError):  # the official client sees a 400 too
        client(url).completions.create(model=MODEL, prompt="hi", max_tokens=-1)


def test_part01_refuses_streaming(llm01):
    app = importlib.import_module("part01_simple_server.server").build_app(llm01, MODEL)
    with running_server(app) as url:
        with pytest.raises(openai.BadRequestError) as e:
            client(url).completions.create(model=MODEL, prompt="hi", stream=True)
        assert e.value.body["param"] == "stream"


# ---- streaming (part 02 on) -----------------------------------------------------------

def test_streamed_completion_equals_non_streamed(streaming_server, prompt_token_ids):
    url, _ = streaming_server
    c = client(url)
    for ids in prompt_token_ids[:4]:
        whole = c.completions.create(model=MODEL, prompt=ids, **GREEDY).choices[0].text
        chunks = list(c.completions.create(model=MODEL, prompt=ids, stream=True,
                                           stream_options={"include_usage": True}, **GREEDY))
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == whole
        assert len([ch for ch in chunks if ch.choices]) > 5  # really token by token
        assert chunks[-1].usage.completion_tokens == 32 and not chunks[-1].choices


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


def _long_stream(url: str, max_tokens: int, seen: list, stop_after: int | None = None) -> None:
    body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": max_tokens,
            "stream": True, "ignore_eos": True, "temperature": 0}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen.append(time.monotonic())
                if stop_after is not None and len(seen) >= stop_after:
                    return  # leaving the block closes the connection: a client disconnect


def test_health_answers_during_long_generation(streaming_server):
    url, _ = streaming_server
    seen: list = []
    t = threading.Thread(target=_long_stream, args=(url, 200, seen))
    t.start()
    while len(seen) < 3:
        time.sleep(0.01)
    start = time.monotonic()
    assert httpx.get(f"{url}/health", timeout=5).status_code == 200
    latency = time.monotonic() - start
    still_generating = t.is_alive()
    t.join()
    assert still_generating and latency < 1.0


def test_disconnect_aborts_generation(streaming_server):
    url, app = streaming_server
    async_llm = app.state.async_llm
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


@pytest.mark.parametrize("part", PARTS)
def test_module_entry_point(part):
    """`python -m partNN.server` really starts and serves (subprocess, real CLI)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", f"{part}.server", "--port", str(port)],
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.25)
        resp = client(url).completions.create(model=MODEL, prompt="The capital of France is", max_tokens=3,
                                              temperature=0)
        assert resp.choices[0].text.strip().startswith("Paris")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_non_streaming_disconnect_aborts_too(streaming_server):
    url, app = streaming_server
    async_llm = app.state.async_llm
    aborted_before = async_llm.num_aborted
    body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 2000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(f"{url}/v1/completions", json=body, timeout=httpx.Timeout(60, read=1.0))
    deadline = time.monotonic() + 30
    while (async_llm.num_unfinished or async_llm.num_aborted == aborted_before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert async_llm.num_unfinished == 0 and async_llm.num_aborted == aborted_before + 1
