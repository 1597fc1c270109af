"""Streams on the wire as vLLM's server sends them, in every part that streams.

vLLM's server (and OpenAI's API) end each SSE event with a blank line, `\\n\\n`: `data: {...}\\n\\n`
for every chunk, the usage chunk (`"choices": []`) last when the request asks for it, then
`data: [DONE]\\n\\n`. Clients split on exactly that. vLLM's `bench serve` client, for one, buffers
what it reads, cuts complete events at `\\n\\n`, and takes a leftover as an event only when it parses
on its own; an event ended by `\\r\\n\\r\\n` (sse-starlette's default) has no `\\n\\n` in it, so two
of them arriving in one network read (the usage chunk and `[DONE]`, typically) are never parsed.

The tests read the raw bytes of a completion and a chat stream from one server per distinct
server.py (`shared.course.server_groups()`, on a tiny random model), and parse the same bytes with
`NewlineSplitClient` (the client described above) delivered in one read, in two reads whose cut
falls anywhere, and byte by byte."""
from __future__ import annotations

import codecs
import json
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from conftest import build_app, build_llm, part_number, running_server
from shared import course
from shared.serving import sse_response

MODEL = "tiny"
TOKENS = 4
STREAMING_PARTS = [g[-1].name for g in course.server_groups() if g[-1].number >= 2]


class NewlineSplitClient:
    """An SSE reader that splits events on `\\n\\n`, as vLLM's benchmark client does: each read is
    appended to a buffer, every complete event is cut off it, and a leftover that starts with
    `data: ` is taken as an event once its payload parses (`[DONE]` or whole JSON)."""

    def __init__(self) -> None:
        self.buffer = ""
        self.decoder = codecs.getincrementaldecoder("utf-8")()

    def feed(self, data: bytes) -> list[str]:
        self.buffer += self.decoder.decode(data)
        events = []
        while "\n\n" in self.buffer:
            event, self.buffer = self.buffer.split("\n\n", 1)
            if event.strip():
                events.append(event.strip())
        if self.buffer.startswith("data: "):
            payload = self.buffer.removeprefix("data: ").strip()
            try:
                if payload != "[DONE]":
                    json.loads(payload)
            except json.JSONDecodeError:
                return events  # not complete yet: wait for the next read
            events.append(self.buffer.strip())
            self.buffer = ""
        return events


def parse(reads: list[bytes]) -> list[str]:
    """The payloads (after `data: `) a NewlineSplitClient finds in these network reads."""
    client = NewlineSplitClient()
    events = [e for r in reads for e in client.feed(r)]
    assert all(e.startswith("data: ") for e in events), events
    return [e.removeprefix("data: ") for e in events]


def deliveries(body: bytes) -> dict[str, list[bytes]]:
    """The same bytes as the network might hand them over: all in one read, cut in two anywhere
    (every cut point), one byte a read."""
    ways = {"one read": [body], "byte by byte": [body[i:i + 1] for i in range(len(body))]}
    for cut in range(1, len(body)):
        ways[f"cut at {cut}"] = [body[:cut], body[cut:]]
    return ways


def check_stream(body: bytes, obj: str) -> list[dict]:
    """What a client splitting on `\\n\\n` reads from these bytes, however they arrive, and the bytes
    themselves: `data: <payload>` events each ended by `\\n\\n`, nothing else (no `\\r`, no comments),
    the usage chunk (`"choices": []`) and `[DONE]` last. Returns the JSON chunks."""
    events = parse([body])
    assert events and events[-1] == "[DONE]", (
        f"a client splitting events on \\n\\n finds {len(events)} events in one read of {body[-120:]!r}")
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == obj for c in chunks)
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == TOKENS
    assert all(c["choices"] for c in chunks[:-1])  # only the usage chunk has none
    for how, reads in deliveries(body).items():
        assert parse(reads) == events, how
    assert body == "".join(f"data: {e}\n\n" for e in events).encode()
    return chunks


# ---------------------------------------------------------------- the shared helper


def test_sse_response_sends_data_lines_ended_by_a_blank_line():
    app = FastAPI()

    @app.get("/s")
    async def s():
        async def events():
            yield json.dumps({"n": 1})
            yield json.dumps({"n": 2, "text": "two\nlines"})  # JSON escapes it: one line on the wire
            yield "[DONE]"
        return sse_response(events())

    with running_server(app) as url, httpx.stream("GET", f"{url}/s", timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        body = r.read()
    assert body == b'data: {"n": 1}\n\ndata: {"n": 2, "text": "two\\nlines"}\n\ndata: [DONE]\n\n'
    for how, reads in deliveries(body).items():
        assert parse(reads) == ['{"n": 1}', '{"n": 2, "text": "two\\nlines"}', "[DONE]"], how


def test_the_client_drops_events_ended_by_crlf():
    """What the servers sent before: the same events under sse-starlette's default separator.
    The usage chunk and [DONE] in one read are lost, which is why the tests below use this client."""
    usage = json.dumps({"choices": [], "usage": {"completion_tokens": 4}})
    crlf = f"data: {usage}\r\n\r\ndata: [DONE]\r\n\r\n".encode()
    assert parse([crlf]) == []
    lf = crlf.replace(b"\r\n", b"\n")
    assert parse([lf]) == [usage, "[DONE]"]


# ---------------------------------------------------------------- every server that streams


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from test_part15_server import tiny_model_folder

    return tiny_model_folder(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module", params=STREAMING_PARTS)
def url(request, tiny):
    part = request.param
    pool = {"kv_cache_memory_mb": 16} if part_number(part) >= 3 else {}
    llm = build_llm(part, model=str(tiny), load_format="dummy", **pool)
    with running_server(build_app(part, llm, MODEL)) as url:
        yield url


def raw_stream(url: str, path: str, body: dict) -> bytes:
    body = {"model": MODEL, "max_tokens": TOKENS, "ignore_eos": True, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **body}
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        return r.read()


def test_completion_stream_bytes(url):
    body = raw_stream(url, "/v1/completions", {"prompt": "Hello, my name is"})
    chunks = check_stream(body, "text_completion")
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


def test_chat_stream_bytes(url):
    body = raw_stream(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})
    chunks = check_stream(body, "chat.completion.chunk")
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
