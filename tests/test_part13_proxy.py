"""The disaggregation proxy against fake prefill and decode servers (no model, no engine).

The fakes are small FastAPI apps that record what they received and the exact bytes they sent,
so every check compares the proxy's behaviour with what the servers really saw and said."""
from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
import uuid
from dataclasses import dataclass

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from conftest import running_server
from part13_disagg.proxy import build_app, parse_args

# What P must be told, as the brief and vLLM's toy proxy have it (not read from the module).
P_SIDE_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None}
BAD_TEMPERATURE = {"error": {"message": "temperature must be non-negative", "type": "invalid_request_error",
                             "param": "temperature", "code": None}}


@dataclass
class Received:
    path: str
    request_id: str | None
    body: dict


class FakeServer:
    """An OpenAI server stand-in in the role of a prefill ("P") or decode ("D") instance."""

    def __init__(self, name: str, role: str) -> None:
        self.name, self.role = name, role
        self.received: list[Received] = []
        self.sent: list[bytes] = []  # each answer's body, byte for byte
        self.error: tuple[int, dict] | None = None  # answer every generation request with this
        self.healthy, self.omit_kv, self.break_stream = True, False, False
        self.hang, self.released = False, threading.Event()  # hang until released (by the test's end)
        self.gate: threading.Event | None = None  # if set: a stream waits after its first chunk
        self.app = self._build()

    def _reply(self, status: int, obj: dict) -> Response:
        data = json.dumps(obj).encode()
        self.sent.append(data)
        return Response(data, status, media_type="application/json")

    def _build(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health():
            return Response(status_code=200 if self.healthy else 503)

        @app.get("/v1/models")
        async def models():
            return self._reply(200, {"object": "list", "data": [{"id": f"model-of-{self.name}", "object": "model"}]})

        @app.post("/v1/completions")
        @app.post("/v1/chat/completions")
        async def generate(raw: Request):
            body = await raw.json()
            rid = raw.headers.get("x-request-id")
            self.received.append(Received(raw.url.path, rid, body))
            while self.hang and not self.released.is_set():
                await asyncio.sleep(0.02)
            if body.get("temperature", 1.0) < 0:
                return self._reply(400, BAD_TEMPERATURE)
            if self.error is not None:
                return self._reply(*self.error)
            chat = raw.url.path.endswith("chat/completions")
            if self.role == "P":
                kv = None if self.omit_kv else {
                    "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.name,
                    "remote_block_ids": [len(self.received), 7], "remote_host": "127.0.0.1",
                    "remote_port": 5600 + len(self.received), "remote_request_id": rid}
                return self._reply(200, self._answer(chat, rid, "x", kv))
            text = f"{self.name} answers {rid} with blocks {body['kv_transfer_params']['remote_block_ids']}"
            if not body.get("stream"):
                return self._reply(200, self._answer(chat, rid, text, None))
            return StreamingResponse(self._stream(chat, rid, text.split()), media_type="text/event-stream")

        return app

    @staticmethod
    def _answer(chat: bool, rid: str, text: str, kv: dict | None) -> dict:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}} if chat else {"index": 0, "text": text}
        return {"id": f"cmpl-{rid}", "object": "chat.completion" if chat else "text_completion", "model": "m",
                "choices": [dict(choice, finish_reason="length")], "kv_transfer_params": kv}

    async def _stream(self, chat: bool, rid: str, words: list[str]):
        self.sent.append(b"")
        for i, w in enumerate(words):
            delta = {"index": 0, "delta": {"content": w + " "}} if chat else {"index": 0, "text": w + " "}
            chunk = f"data: {json.dumps({'id': f'cmpl-{rid}', 'choices': [delta]})}\n\n".encode()
            self.sent[-1] += chunk  # before yielding: once the client has it all, so has `sent`
            yield chunk
            await asyncio.sleep(0.001)  # separate writes: the proxy must pass each on, not rebuild
            while self.gate is not None and not self.gate.is_set() and not self.released.is_set():
                await asyncio.sleep(0.02)
            if self.break_stream and i == 1:
                raise RuntimeError("decode server dies mid-stream")  # uvicorn drops the connection
        self.sent[-1] += b"data: [DONE]\n\n"
        yield b"data: [DONE]\n\n"


@contextlib.contextmanager
def dead_url():
    """A loopback port bound but not listening: a connection to it is refused for sure."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


@contextlib.contextmanager
def cluster(n_prefill: int = 1, n_decode: int = 1, timeout_s: float = 10.0, dead_prefill: bool = False,
            dead_decode: bool = False):
    """Fake P and D servers and the proxy in front of them; a dead URL comes first in its list."""
    prefills = [FakeServer(f"P{i}", "P") for i in range(n_prefill)]
    decodes = [FakeServer(f"D{i}", "D") for i in range(n_decode)]
    with contextlib.ExitStack() as stack:
        p_urls = [stack.enter_context(running_server(f.app)) for f in prefills]
        d_urls = [stack.enter_context(running_server(f.app)) for f in decodes]
        if dead_prefill:
            p_urls.insert(0, stack.enter_context(dead_url()))
        if dead_decode:
            d_urls.insert(0, stack.enter_context(dead_url()))
        app = build_app(p_urls, d_urls, timeout_s=timeout_s)
        url = stack.enter_context(running_server(app))  # left first: the proxy stops before the fakes
        stack.callback(lambda: [f.released.set() for f in prefills + decodes])  # before any server stops
        client = stack.enter_context(httpx.Client(base_url=url, timeout=60, trust_env=False))
        yield client, prefills, decodes, p_urls, d_urls, app


def kv_sent_by(prefill: FakeServer, i: int) -> dict:
    return json.loads(prefill.sent[i])["kv_transfer_params"]


def test_prefill_and_decode_get_the_right_requests():
    with cluster() as (client, (p,), (d,), *_):
        body = {"model": "m", "prompt": "Hello", "max_tokens": 7, "temperature": 0.5, "n": 2, "min_tokens": 3,
                "stream": False, "kv_transfer_params": {"from": "client"}}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200
        rid = r.headers["x-request-id"]
        assert uuid.UUID(rid).version == 4
        (pr,), (dr,) = p.received, d.received
        assert pr.path == dr.path == "/v1/completions" and pr.request_id == dr.request_id == rid
        assert pr.body == {"model": "m", "prompt": "Hello", "max_tokens": 1, "temperature": 0.5, "n": 1,
                           "stream": False, "kv_transfer_params": P_SIDE_PARAMS}
        assert dr.body == dict(body, kv_transfer_params=kv_sent_by(p, 0))  # original + P's params
        assert r.content == d.sent[0]
        assert r.headers["content-type"].startswith("application/json")
        r2 = client.post("/v1/completions", json=body)
        assert r2.headers["x-request-id"] not in (rid, None)


def test_chat_stream_request_shapes_and_client_request_id():
    with cluster() as (client, (p,), (d,), *_):
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 9,
                "min_completion_tokens": 2, "stream": True, "stream_options": {"include_usage": True}}
        with client.stream("POST", "/v1/chat/completions", json=body, headers={"X-Request-Id": "mine-1"}) as r:
            got = b"".join(r.iter_raw())
        assert r.status_code == 200 and r.headers["x-request-id"] == "mine-1"
        assert r.headers["content-type"].startswith("text/event-stream")
        assert got == d.sent[0] and got.endswith(b"data: [DONE]\n\n")
        (pr,), (dr,) = p.received, d.received
        assert pr.request_id == dr.request_id == "mine-1"
        assert pr.body == {"model": "m", "messages": body["messages"], "max_completion_tokens": 1,
                           "max_tokens": 1, "n": 1, "stream": False, "kv_transfer_params": P_SIDE_PARAMS}
        assert dr.body == dict(body, kv_transfer_params=kv_sent_by(p, 0))


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_answers_come_back_exactly_as_the_decode_sent_them(path, stream):
    with cluster() as (client, _, (d,), *_):
        body = {"model": "m", "max_tokens": 5, "stream": stream}
        body.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"})
        with client.stream("POST", path, json=body) as r:
            got = b"".join(r.iter_raw())
        assert r.status_code == 200 and len(d.sent) == 1 and got == d.sent[0]
        assert r.headers["content-type"].startswith("text/event-stream" if stream else "application/json")


def test_stream_is_passed_on_as_it_comes():
    """The first chunk reaches the client while the decode server is still holding the rest back:
    a proxy that buffered the stream would make this read wait for the test client's timeout."""
    with cluster() as (client, _, (d,), *_):
        d.gate = threading.Event()
        with client.stream("POST", "/v1/completions", json={"prompt": "hi", "stream": True}, timeout=20) as r:
            chunks = r.iter_raw()
            got = b""
            while not got.endswith(b"\n\n"):
                got += next(chunks)
            assert got == d.sent[0]  # all D has sent so far: its first event
            d.gate.set()
            got += b"".join(chunks)
        assert got == d.sent[0] and got.endswith(b"data: [DONE]\n\n")


def test_round_robin_over_2p2d():
    with cluster(2, 2) as (client, prefills, decodes, *_):
        rids = [client.post("/v1/completions", json={"prompt": f"q{i}", "max_tokens": 3}).headers["x-request-id"]
                for i in range(4)]
        for k in range(2):
            assert [x.request_id for x in prefills[k].received] == rids[k::2]
            assert [x.request_id for x in decodes[k].received] == rids[k::2]
        for i in range(4):  # request i went P(i%2) -> D(i%2), and D got exactly that P's params
            got = decodes[i % 2].received[i // 2].body["kv_transfer_params"]
            assert got == kv_sent_by(prefills[i % 2], i // 2) and got["remote_engine_id"] == f"P{i % 2}"


@pytest.mark.parametrize("stream", [False, True])
def test_prefill_400_passes_through_and_decode_is_not_called(stream):
    with cluster() as (client, (p,), (d,), *_):
        r = client.post("/v1/completions", json={"prompt": "hi", "temperature": -1, "stream": stream})
        assert r.status_code == 400 and r.content == p.sent[0] and r.json() == BAD_TEMPERATURE
        assert d.received == [] and r.headers["x-request-id"]


@pytest.mark.parametrize("stream", [False, True])
def test_decode_error_status_passes_through(stream):
    with cluster() as (client, _, (d,), *_):
        d.error = (429, {"error": {"message": "too many", "type": "rate_limit", "param": None, "code": 429}})
        r = client.post("/v1/completions", json={"prompt": "hi", "stream": stream})
        assert r.status_code == 429 and r.content == d.sent[0]


def assert_openai_error(r: httpx.Response, status_codes: tuple[int, ...], mentions: str) -> None:
    assert r.status_code in status_codes
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and mentions in err["message"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("dead", ["prefill", "decode"])
def test_dead_server_gives_503_and_the_proxy_keeps_serving(dead, stream):
    kw = {f"dead_{dead}": True}
    with cluster(**kw) as (client, (p,), (d,), p_urls, d_urls, _):
        body = {"prompt": "hi", "max_tokens": 2, "stream": stream}
        r = client.post("/v1/completions", json=body)  # round-robin: the dead one first
        assert_openai_error(r, (502, 503), (p_urls if dead == "prefill" else d_urls)[0])
        assert r.headers["x-request-id"]
        r = client.post("/v1/completions", json=body)  # then the live one
        assert r.status_code == 200 and r.content == d.sent[-1]


def test_hung_prefill_times_out_instead_of_hanging():
    with cluster(2, 1, timeout_s=0.5) as (client, prefills, (d,), p_urls, _, _):
        prefills[0].hang = True
        start = time.monotonic()
        r = client.post("/v1/completions", json={"prompt": "hi"})
        # Without the proxy's timeout this would wait for the release at teardown (or the test
        # client's 60 s): 30 s leaves any slow machine room and still proves the bound.
        assert time.monotonic() - start < 30
        assert_openai_error(r, (502, 503, 504), p_urls[0])
        assert d.received == []
        r = client.post("/v1/completions", json={"prompt": "hi"})  # P1 is fine
        assert r.status_code == 200 and r.content == d.sent[-1]


def test_prefill_without_kv_transfer_params_is_a_502():
    with cluster() as (client, (p,), (d,), p_urls, _, _):
        p.omit_kv = True
        assert_openai_error(client.post("/v1/completions", json={"prompt": "hi"}), (502,), p_urls[0])
        assert d.received == []


def test_decode_dying_mid_stream_ends_with_an_error_event():
    with cluster() as (client, _, (d,), *_):
        d.break_stream = True
        with client.stream("POST", "/v1/completions", json={"prompt": "hi", "stream": True}) as r:
            got = b"".join(r.iter_raw())
        assert r.status_code == 200
        assert got.startswith(d.sent[0]) and b"[DONE]" not in got  # what D sent, then the error
        last = json.loads(got[len(d.sent[0]):].decode().removeprefix("data: "))
        assert set(last["error"]) == {"message", "type", "param", "code"}


def test_health_and_models():
    with cluster(1, 2) as (client, (p,), decodes, p_urls, d_urls, _):
        for route in ("/health", "/healthcheck"):
            assert client.get(route).status_code == 200
        r = client.get("/v1/models")
        assert r.status_code == 200 and r.content == decodes[0].sent[-1]  # the first decode server's
        decodes[1].healthy = False
        for route in ("/health", "/healthcheck"):
            r = client.get(route)
            assert_openai_error(r, (503,), d_urls[1])
            assert p_urls[0] not in r.json()["error"]["message"] and d_urls[0] not in r.json()["error"]["message"]


def test_health_503_when_a_server_is_down():
    with cluster(dead_prefill=True) as (client, _, _, p_urls, d_urls, _):
        r = client.get("/health")
        assert_openai_error(r, (503,), p_urls[0])
        assert p_urls[1] not in r.json()["error"]["message"] and d_urls[0] not in r.json()["error"]["message"]


def test_shared_client_is_closed_on_shutdown():
    with cluster() as (client, *_, app):
        assert client.post("/v1/completions", json={"prompt": "hi"}).status_code == 200
        assert not app.state.client.is_closed
    assert app.state.client.is_closed


def test_cli():
    args = parse_args(["--port", "9000", "--prefill", "http://a:1", "http://b:2", "--decode", "http://c:3",
                       "--timeout-s", "5"])
    assert (args.host, args.port, args.prefill, args.decode, args.timeout_s) == \
        ("127.0.0.1", 9000, ["http://a:1", "http://b:2"], ["http://c:3"], 5.0)
    with pytest.raises(SystemExit):
        parse_args(["--prefill", "http://a:1"])  # --decode is required
    with pytest.raises(ValueError):
        build_app([], ["http://c:3"])
